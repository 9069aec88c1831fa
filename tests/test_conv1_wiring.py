"""conv1's settings in the engine, on the stand-in cupy (tests/standin.py; our kernels run
by their host build; tests/test_conv1_device.py checks the kernels' numbers).

* ``conv1_algorithm: direct`` sends a layer's forward to one ``conv_direct_forward``
  launch (no epilogue launch after it), with the kernel's own bits, bf16 read and
  written as stored;
* as the engine's distributed layer on D2 and W2 (two ranks: halo views, interior and
  shell calls, asymmetric boundary padding) each rank's block and the summed weight
  gradient are the serial layer's;
* a whole training step with both settings gives the CPU step's losses (which hardly
  depend on conv1 at initialisation: they check the wiring), the same launches every
  steady step and no host read inside one, and its CUDA graph (engine/cuda_graph.py)
  replays it bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import abort_on_error
from cuda_host import HostLauncher, need_compiler
from test_conv1_device import values

from cosmotrain.kernels import conv3d
from cosmotrain.kernels.cuda import conv1, raw_ops
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.precision import bfloat16, widen


DIRECT = ConvSettings(algorithm="gemm", conv1_algorithm="direct")


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("fused", [(True, 0.3), (False, None), (True, None)])
def test_the_front_door_sends_conv1_to_one_direct_launch(name: str, fused: tuple,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """``conv1_algorithm: direct``: the forward, its bias and the fused LeakyReLU are one
    ``conv_direct_forward`` launch (no epilogue pass after it), bf16 read and written as
    stored: the kernel's bits (whose accuracy the tests above check), and in float32 the
    CPU front door's result within summation error."""
    from standin import installed

    from cosmotrain.device.xp import to_host

    need_compiler()
    dtype = bfloat16() if name == "bfloat16" else np.dtype(np.float32)
    x, w = values((2, 4, 6, 5, 7), 1, dtype), values((16, 4, 3, 3, 3), 2, dtype)
    bias = values((16,), 3, dtype) if fused[0] else None
    want = conv3d.conv3d_forward(x, w, 1, 1, bias=bias, activation=fused[1])
    with installed(monkeypatch) as cupy:
        args = [None if a is None else cupy.asarray(a) for a in (x, w, bias)]
        cupy.ledger.take()
        got = conv3d.conv3d_forward(args[0], args[1], 1, 1, settings=DIRECT, bias=args[2],
                                    activation=fused[1])
        launches = [launch.kernel for launch in cupy.ledger.take().launches]
        got = to_host(got)
    suffix = "f32" if name == "float32" else "bf16"
    bias_cast = ["astype"] if name == "bfloat16" and fused[0] else []  # (16,) to float32
    assert launches == [*bias_cast, "empty", f"conv_direct_forward_{suffix}"], launches
    assert got.dtype == dtype
    bias32 = None if bias is None else widen(bias)
    np.testing.assert_array_equal(  # the kernel's own bits: the arguments are passed right
        widen(got), widen(raw_ops.conv_direct_forward(x, w, 1, bias32, fused[1],
                                                      launch=HostLauncher())))
    if name == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def device_losses(monkeypatch: pytest.MonkeyPatch, extra: list[str], steps: int = 3
                  ) -> tuple[list[float], list[Any]]:
    """The paper network's losses over ``steps`` steps on the stand-in GPU (gemm
    convolutions, ``extra`` device settings) and each step's ledger."""
    from mpi4py import MPI
    from standin import installed

    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.config.layout import resolve_parallel
    from cosmotrain.device.select import Device
    from cosmotrain.engine.step import hybrid_step_from_config, job_runtime

    cfg, (x, targets) = paper_config(extra), paper_batch()
    with installed(monkeypatch) as cupy:
        grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
        device = Device("gpu", 0, cfg.device.precision, "staging", "gemm",
                        conv1_channels_pad=cfg.device.conv1_channels_pad,
                        conv1_algorithm=cfg.device.conv1_algorithm)
        step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
        losses, ledgers = run_steps(step, cfg, x, targets, steps, cupy.ledger)
        grid.free()
    return losses, ledgers


def paper_config(extra: list[str] = ()) -> Any:
    from cosmotrain.config.load import load_config

    return load_config(None, ["model.name=cosmoflow", "model.width=16", "train.batch_size=2",
                              "optimizer.name=sgd", "optimizer.lr=0.002",
                              "optimizer.momentum=0.9", *extra])


def paper_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return (rng.normal(size=(2, 4, 16, 16, 16)).astype(np.float32),
            rng.normal(size=(2, 4)).astype(np.float32))


def run_steps(step: Any, cfg: Any, x: np.ndarray, targets: np.ndarray, steps: int,
              ledger: Any = None) -> tuple[list[float], list[Any]]:
    from cosmotrain.nn.module import Context
    from cosmotrain.tensor.dist_tensor import DistTensor

    losses, ledgers = [], []
    for it in range(steps):
        dist, coord = step.model.input_distribution(x.shape)
        if ledger is not None:
            ledger.take()
        out = step(DistTensor.scatter(x, dist, coord), targets,
                   Context(step=it, seed=cfg.train.seed))
        if ledger is not None:
            ledgers.append(ledger.take())
        losses.append(out.loss)
    return losses, ledgers


@pytest.mark.parametrize("direct", [True, False])
def test_a_training_step_with_the_conv1_settings_is_the_cpus(
        direct: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper network's step on the stand-in GPU with conv1's channels padded to 8
    and conv1 on the direct kernels (the LeakyReLU fused into the forward; the weight
    gradient's launches) or on the padded library path: the CPU step's losses, the
    same launches every steady step and no host read inside one; on the library path
    the padded input made by each call (forward, weight gradient), the padded weight
    once per run."""
    from mpi4py import MPI

    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.config.layout import resolve_parallel
    from cosmotrain.engine.step import hybrid_step_from_config

    need_compiler()
    conv1._PADDED_WEIGHTS.clear()
    algorithm = "direct" if direct else "default"
    losses, ledgers = device_losses(monkeypatch, ["device.conv1_channels_pad=8",
                                                  f"device.conv1_algorithm={algorithm}"])
    cfg = paper_config()
    grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
    host, _ = run_steps(hybrid_step_from_config(cfg, grid), cfg, *paper_batch(), 3)
    grid.free()
    np.testing.assert_allclose(losses, host, rtol=1e-5)
    first, second = ledgers[-2], ledgers[-1]
    kernels = [launch.kernel for launch in second.launches]
    for kernel in ("forward", "wgrad"):
        assert kernels.count(f"conv_direct_{kernel}_f32") == int(direct)
    assert kernels.count("conv_direct_wgrad_reduce_f32") == 2 * direct  # 512 chunks
    assert kernels == [launch.kernel for launch in first.launches]
    assert not second.syncs and first.allocations == second.allocations
    assert second.allocations.count(((2, 8, 16, 16, 16), "<f4")) == 2 * (not direct)
    assert len(conv1._PADDED_WEIGHTS) == (not direct)
    assert ((16, 8, 3, 3, 3), "<f4") not in second.allocations  # made at step 0 only


@pytest.mark.parametrize("conv1_settings", [{"conv1_algorithm": "direct"},
                                            {"conv1_channels_pad": 8}])
def test_conv1_settings_replay_in_a_cuda_graph(conv1_settings: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/cuda_graph.py captures a step with conv1's direct kernels or its padded
    operands (the persistent padded weight made in the warm-up, the padded input in
    the graph's pool) and its replays train as the eager step, bit for bit
    (tests/test_cuda_graph.py's runner, its device given these settings)."""
    import functools

    import test_cuda_graph
    from test_gpu_step_counts import batch

    from cosmotrain.device.select import Device

    need_compiler()
    conv1._PADDED_WEIGHTS.clear()
    monkeypatch.setattr(test_cuda_graph, "Device", functools.partial(Device, **conv1_settings))
    batches = [batch("cosmoflow")] * 5
    eager = test_cuda_graph.run(monkeypatch, "eager", batches)  # the same job, uncaptured
    graphed = test_cuda_graph.run(monkeypatch, "true", batches)
    assert graphed["captures"] == 1
    test_cuda_graph.assert_same_training(eager, graphed)
    launched = {launch.kernel for ledger in graphed["ledgers"] for launch in ledger.launches}
    direct = "conv1_algorithm" in conv1_settings
    assert ("conv_direct_forward_f32" in launched) == direct
    assert len(conv1._PADDED_WEIGHTS) == (not direct)


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_conv1_direct_on_spatial_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """D2 and W2 (two ranks): conv1 as the engine's distributed layer on the stand-in
    GPU, on the direct kernels.  Its blocks are views of their halo buffers, its
    interior and shell separate calls, padded on the global boundary only (asymmetric);
    each rank's output block (bias and fused LeakyReLU included) and the weight
    gradient summed over the ranks equal the serial float64 layer's, within float32
    error.  Verdict allreduced."""
    from conv_reference import serial_conv_run
    from mpi4py import MPI
    from standin import installed

    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.config.layout import Layout
    from cosmotrain.device.select import Device
    from cosmotrain.device.xp import to_host
    from cosmotrain.layers.conv import spatial_conv
    from cosmotrain.nn import factory
    from cosmotrain.runtime.job_runtime import build_runtime
    from cosmotrain.nn.module import Context
    from cosmotrain.tensor.dist_tensor import DistTensor
    from cosmotrain.tensor.distribution import Distribution

    need_compiler()
    world, ok = MPI.COMM_WORLD, True

    def make() -> Any:
        layer = factory.conv("conv1", 4, 16, 3, 1, 1, bias=True)
        layer.needs_input_grad = False
        return layer

    serial, x, y, dy, _ = serial_conv_run(make, 4, (8, 6, 10), seed=3)
    want, dw = np.maximum(y, 0.3 * y), serial.params["weight"].grad
    with installed(monkeypatch) as cupy:
        for layout in (Layout(1, depth=2), Layout(1, width=2)):
            grid = ProcessGrid(world, layout)
            device = Device("gpu", 0, conv_algorithm="gemm", conv1_algorithm="direct")
            layer = spatial_conv(make(), grid, build_runtime(device, grid.cart))
            for key, param in layer.params.items():
                param.data = cupy.asarray(serial.params[key].data.astype(np.float32))
            dist = Distribution(x.shape, (1, 1, *layout.spatial))
            coord = (0, 0, *grid.spatial_coords)
            block = DistTensor.scatter(x.astype(np.float32), dist, coord)
            layer.take_activation(0.3)
            cupy.ledger.take()
            out = layer.forward(DistTensor(cupy.asarray(block.data), dist, coord), Context())
            grads = DistTensor.scatter(dy.astype(np.float32), out.dist, coord)
            layer.backward(DistTensor(cupy.asarray(grads.data), out.dist, coord), Context())
            kernels = [launch.kernel for launch in cupy.ledger.take().launches]
            ok &= kernels.count("conv_direct_forward_f32") >= 1
            ok &= kernels.count("conv_direct_wgrad_f32") == 1
            ok &= np.allclose(to_host(out.data), want[out.dist.block(coord)], rtol=1e-5,
                              atol=1e-4)
            total = world.allreduce(to_host(layer.params["weight"].grad).astype(np.float64))
            ok &= np.allclose(total, dw, rtol=1e-5, atol=1e-3)
            grid.free()
    assert world.allreduce(int(not ok)) == 0
