"""The job's runtime carries the GPU kernel settings down to every kernel call (issue 22).

No GPU here: the convolution dispatch in ``kernels/conv3d.py`` is made to treat numpy
arrays as device arrays and its CUDA module is replaced by a recorder that forwards to
the real one (whose numpy path is the gemm fallback, which reads the settings' GEMM
budget); the linear kernels' cuBLAS math switch is replaced by a recorder.  Two models
built side by side from two runtimes then show that each layer calls its kernels with
its own runtime's settings, whichever model ran last: nothing is read from a global.
"""

from __future__ import annotations

from dataclasses import replace

import types
from contextlib import contextmanager

import numpy as np
import pytest

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime, build_runtime
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.load import load_config
from cosmotrain.device.select import Device
from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels import conv3d, linear
from cosmotrain.kernels.route import Route
from cosmotrain.kernels.cuda import conv as gpu_conv
from cosmotrain.kernels.cuda import conv_gemm
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.layers.conv import SpatialConv3d
from cosmotrain.layers.hybrid import build_hybrid
from cosmotrain.models import build_model
from cosmotrain.nn.layers import Conv3d, Linear
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.step import hybrid_step_from_config

# conv1 and pool1 on blocks, conv2 and the linear layers on whole samples
TINY = ["model.name=tiny", "model.width=13", "train.batch_size=2",
        "parallel.spatial_until=conv2"]
CONV_OPS = ("conv3d_forward", "conv3d_backward_data", "conv3d_backward_filter")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every GPU convolution call as ``(op, settings, gemm budget)`` and every linear
    GEMM's TF32 request, with numpy arrays taken for device arrays."""
    calls: dict[str, list] = {"conv": [], "linear": [], "budgets": []}

    def recorder(op):
        def call(*args, settings=None):
            calls["conv"].append((op, settings))
            return getattr(gpu_conv, op)(*args, settings=settings)
        return call

    monkeypatch.setattr(conv3d, "route", lambda *arrays: Route(device=True, bf16=False))
    monkeypatch.setattr(conv3d, "cuda_conv",
                        types.SimpleNamespace(**{op: recorder(op) for op in CONV_OPS}))
    chunks = conv_gemm.gemm_chunks
    monkeypatch.setattr(conv_gemm, "gemm_chunks", lambda geo, itemsize, budget: (
        calls["budgets"].append(budget) or chunks(geo, itemsize, budget)))

    @contextmanager
    def math(xp, tf32):
        calls["linear"].append(tf32)
        yield

    monkeypatch.setattr(linear, "route", lambda *arrays: Route(device=True, bf16=False))
    monkeypatch.setattr(linear, "array_module", lambda *arrays: types.SimpleNamespace())
    monkeypatch.setattr(linear, "cublas_math", math)
    return calls


def one_step(step) -> None:
    x = np.random.default_rng(0).normal(size=(2, 4, 13, 13, 13)).astype(np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    step(DistTensor.scatter(x, dist, coord), np.zeros((2, 4), np.float32), Context())


def test_layers_pass_their_runtimes_settings_to_the_kernels(kernel_calls) -> None:
    from mpi4py import MPI

    cfg = load_config(None, TINY)
    grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
    first = ConvSettings(algorithm="gemm", math="tf32", gemm_budget_bytes=1 << 20)
    second = ConvSettings(algorithm="gemm", gemm_budget_bytes=3 << 20, graph_cache_size=9)
    steps = {settings: hybrid_step_from_config(cfg, grid, Runtime(conv=settings))
             for settings in (first, second)}
    for settings, step in steps.items():
        model = step.model
        assert isinstance(model.spatial.items[0], SpatialConv3d)
        convs = [layer for layer in model.spatial.layers() if isinstance(layer, Conv3d)]
        convs += [layer for layer in model.head.layers() if isinstance(layer, (Conv3d, Linear))]
        assert [layer.name for layer in convs] == ["conv1", "conv2", "fc1", "fc2"]
        assert all(layer.conv_settings is settings for layer in convs)
    for settings in (second, first, second):  # built together, run in any order
        for key in kernel_calls:
            kernel_calls[key].clear()
        one_step(steps[settings])
        ops = [op for op, _ in kernel_calls["conv"]]
        # conv1 (first layer: no data gradient) and conv2, forward and backward
        assert sorted(ops) == sorted(["conv3d_forward"] * 2 + ["conv3d_backward_filter"] * 2
                                     + ["conv3d_backward_data"])
        assert all(seen is settings for _, seen in kernel_calls["conv"])
        assert set(kernel_calls["budgets"]) == {settings.gemm_budget_bytes}
        # fc1 and fc2: forward, weight and data gradients (the head passes its gradient on)
        assert kernel_calls["linear"] == [settings.math == "tf32"] * 6
    grid.free()


def test_head_layers_share_the_serial_models_parameters() -> None:
    """On the host's default runtime the head keeps the serial model's own layers; under
    other settings its convolutions and linear layers are copies holding the same
    parameter objects."""
    from mpi4py import MPI

    cfg = load_config(None, TINY)
    grid = ProcessGrid(MPI.COMM_SELF, replace(resolve_parallel(cfg, 1), spatial_until="conv2"))
    for settings in (ConvSettings(), ConvSettings(math="tf32")):
        model = build_model(cfg.model, 0)
        hybrid = build_hybrid(model, grid, (2, 4, 13, 13, 13), runtime=Runtime(conv=settings))
        serial = {layer.name: layer for layer in model.layers()}
        for layer in hybrid.head.layers():
            if isinstance(layer, (Conv3d, Linear)):
                assert layer.conv_settings == settings
                assert (layer is serial[layer.name]) == (settings == ConvSettings())
                assert layer.params is serial[layer.name].params
    grid.free()


def test_kernels_called_without_settings_use_the_defaults(kernel_calls) -> None:
    rng = np.random.default_rng(1)
    x, w = rng.normal(size=(1, 2, 5, 5, 5)), rng.normal(size=(3, 2, 3, 3, 3))
    y = conv3d.conv3d_forward(x, w, 1, 1)
    assert kernel_calls["conv"] == [("conv3d_forward", None)]
    assert kernel_calls["budgets"] == [ConvSettings().gemm_budget_bytes]
    np.testing.assert_allclose(y, conv_gemm.conv3d_forward(x, w, 1, 1), rtol=1e-12)
    linear.linear_forward(rng.normal(size=(2, 3)), rng.normal(size=(4, 3)), None)
    assert kernel_calls["linear"] == [False]


def test_build_runtime_records_and_applies_the_threads_once(monkeypatch) -> None:
    from mpi4py import MPI

    applied = []
    monkeypatch.setattr(_parallel, "set_blas_threads", lambda count: applied.append(count))
    runtime = build_runtime(Device(), MPI.COMM_SELF, _parallel.KernelThreads(3))
    assert runtime.threads == _parallel.KernelThreads(3) and applied == [3]
    assert build_runtime(Device(), MPI.COMM_SELF).threads is None and applied == [3]
    assert Runtime().threads is None and Runtime().conv == ConvSettings()
