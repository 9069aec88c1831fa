"""The GPU convolution package (cosmotrain.kernels.cuda) against the CPU kernels.

Runs everywhere (numpy):
* the im2col + GEMM fallback (``conv_gemm``), which is written against the array module of
  its inputs, against :mod:`cosmotrain.kernels.conv3d` in float64 (tight), float32 and
  bfloat16 storage (ml_dtypes), with one and many chunks;
* the pure parts of the cuDNN path: symmetric padding + zero extension, channels-last
  strides, graph-cache keys and LRU, numerical-note filters, and the whole wrapper
  (layout conversion, extension, crop) driven by a reference runner that executes each
  graph description with the CPU kernels on strided views of the buffers it is handed;
* settings (passed to every call, never installed), algorithm resolution, the cuBLAS math
  switch and the dispatch in ``conv``.

With ``cudnn`` importable (no GPU needed) the graph description is checked against the
frontend's own IR.  With cupy and a GPU, both algorithms run on the device against the
CPU kernels; without one those tests skip.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import types
import warnings

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from cosmotrain.kernels.conv3d import (conv3d_backward_data, conv3d_backward_filter,
                                       conv3d_forward)
from cosmotrain.kernels.cuda import conv, conv_cudnn, conv_gemm, cudnn_plans, settings
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.kernels.geometry import ConvGeometry, normalize_padding

# N, C, F, spatial, kernel, stride, padding
CASES = [
    (2, 3, 5, (7, 6, 5), 3, 1, 1),
    (1, 4, 7, (9, 8, 10), (2, 3, 4), (2, 1, 2), ((1, 0), (0, 2), (2, 1))),
    (3, 2, 3, (5, 5, 6), (5, 1, 2), (1, 2, 3), ((0, 0), (0, 0), (1, 1))),
    (2, 2, 3, (6, 5, 9), 4, 1, ((3, 0), (1, 2), (0, 3))),
    (1, 2, 3, (8, 7, 9), 2, 3, ((0, 1), (1, 0), (0, 0))),            # stride > kernel
    (1, 2, 2, (3, 4, 3), 2, 1, ((2, 0), (0, 3), (1, 1))),            # padding >= kernel
    (2, 4, 6, (8, 8, 8), 3, 2, ((1, 0), (0, 1), (1, 1))),            # conv4-like, halo sides
]
IDS = [f"case{i}" for i in range(len(CASES))]
OPS = ("fprop", "dgrad", "wgrad")


def make_case(case, seed: int = 0, dtype=np.float64):
    """(x, w, dy, stride, padding) of a case, random normal."""
    n, c, f, spatial, k, stride, pad = case
    k = (k,) * 3 if isinstance(k, int) else k
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + spatial)
    w = rng.standard_normal((f, c) + k)
    geo = ConvGeometry.create(x.shape, w.shape, stride, pad)
    dy = rng.standard_normal(geo.y_shape)
    return x.astype(dtype), w.astype(dtype), dy.astype(dtype), stride, pad


def cpu_reference(op: str, x, w, dy, stride, pad):
    """The CPU kernel's result for ``op`` in float64."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    if op == "fprop":
        return conv3d_forward(x, w, stride, pad)
    if op == "dgrad":
        return conv3d_backward_data(dy, w, x.shape, stride, pad)
    return conv3d_backward_filter(x, dy, w.shape, stride, pad)


def run_op(module, op: str, x, w, dy, stride, pad, **kwargs):
    """``op`` through a module with the conv.py signatures (conv_gemm, conv_cudnn, conv)."""
    if op == "fprop":
        return module.conv3d_forward(x, w, stride, pad, **kwargs)
    if op == "dgrad":
        return module.conv3d_backward_data(dy, w, x.shape, stride, pad, **kwargs)
    return module.conv3d_backward_filter(x, dy, w.shape, stride, pad, **kwargs)


def rel_error(ours, exact) -> float:
    """max |ours - exact| / max |exact| (in float64)."""
    ours, exact = np.asarray(ours, np.float64), np.asarray(exact, np.float64)
    return float(np.abs(ours - exact).max() / np.abs(exact).max())


@pytest.fixture(autouse=True)
def fresh_resolution(monkeypatch):
    """Every test resolves the algorithm afresh (the process keeps one per request)."""
    monkeypatch.setattr(conv, "_resolved", {})


# ---------------------------------------------------------------------------------------
# conv_gemm on numpy


@pytest.mark.parametrize("budget", [1, 1 << 30], ids=["planes", "whole"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gemm_float64_matches_cpu_kernels(case, budget) -> None:
    x, w, dy, stride, pad = make_case(case)
    for op in OPS:
        ours = run_op(conv_gemm, op, x, w, dy, stride, pad, budget=budget)
        exact = cpu_reference(op, x, w, dy, stride, pad)
        assert ours.dtype == np.float64 and ours.shape == exact.shape
        assert ours.flags.c_contiguous
        np.testing.assert_allclose(ours, exact, rtol=1e-12, atol=1e-12 * np.abs(exact).max())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gemm_float32_within_1e5_of_float64(case) -> None:
    x, w, dy, stride, pad = make_case(case, seed=1)
    x32, w32, dy32 = (a.astype(np.float32) for a in (x, w, dy))
    for op in OPS:
        ours = run_op(conv_gemm, op, x32, w32, dy32, stride, pad, budget=4096)
        assert ours.dtype == np.float32
        assert rel_error(ours, cpu_reference(op, x32, w32, dy32, stride, pad)) < 1e-5


@pytest.mark.parametrize("case", CASES[:2] + CASES[-1:], ids=["case0", "case1", "case6"])
def test_gemm_bfloat16_storage_accumulates_in_fp32(case) -> None:
    """bf16 storage: within 1e-2 of the fp32 result, and each output is the exact value
    of the bf16 operands rounded once to bf16 (fp32 accumulation, one rounding): within
    bf16's unit roundoff 2^-8, and bit-equal to the rounded exact value almost everywhere
    (measured: >= 99.8% of elements over these cases; bf16 sums would miss both)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x, w, dy, stride, pad = make_case(case, seed=2)
    xb, wb, dyb = (a.astype(bf16) for a in (x, w, dy))
    for op in OPS:
        ours = run_op(conv_gemm, op, xb, wb, dyb, stride, pad, budget=4096)
        assert ours.dtype == bf16
        assert rel_error(ours, cpu_reference(op, x, w, dy, stride, pad)) < 1e-2
        exact = cpu_reference(op, xb, wb, dyb, stride, pad)  # bf16 operands, float64 sums
        big = np.abs(exact) > 1e-2 * np.abs(exact).max()
        err = np.abs(ours.astype(np.float64) - exact)[big] / np.abs(exact)[big]
        assert err.max() <= 2.0 ** -8 * (1 + 1e-3)
        assert np.mean(ours == exact.astype(bf16)) >= 0.99


def test_gemm_casts_the_second_operand_to_the_storage_dtype() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x, w, dy, stride, pad = make_case(CASES[0], seed=3, dtype=np.float32)
    xb, wb = x.astype(bf16), w.astype(bf16)
    np.testing.assert_array_equal(conv_gemm.conv3d_forward(xb, w, stride, pad),
                                  conv_gemm.conv3d_forward(xb, wb, stride, pad))
    np.testing.assert_array_equal(
        conv_gemm.conv3d_backward_filter(xb, dy, w.shape, stride, pad),
        conv_gemm.conv3d_backward_filter(xb, dy.astype(bf16), w.shape, stride, pad))
    assert conv_gemm.conv3d_backward_data(dy, wb, x.shape, stride, pad).dtype == np.float32


def test_gemm_chunks_cover_outputs_once_within_budget() -> None:
    geo = ConvGeometry.create((5, 4, 16, 12, 10), (8, 4, 3, 3, 3), 1, 1)
    per_plane = (geo.rows + geo.filters) * geo.plane * 4
    for budget in (1, per_plane * 3, per_plane * 16, per_plane * 40, 1 << 40):
        chunks = conv_gemm.gemm_chunks(geo, 4, budget)
        covered = np.zeros((geo.batch, geo.out[0]), int)
        for n0, n1, z0, z1 in chunks:
            covered[n0:n1, z0:z1] += 1
            assert (n1 - n0) * (z1 - z0) * per_plane <= max(budget, per_plane)
        assert (covered == 1).all()
    assert conv_gemm.gemm_chunks(geo, 4, per_plane * 40) == [(0, 2, 0, 16), (2, 4, 0, 16),
                                                               (4, 5, 0, 16)]
    assert len(conv_gemm.gemm_chunks(geo, 4, 1 << 40)) == 1


def test_gemm_rejects_bad_dtypes_and_shapes() -> None:
    x, w, dy, stride, pad = make_case(CASES[0])
    with pytest.raises(ValueError, match="float32, bfloat16 or float64"):
        conv_gemm.conv3d_forward(x.astype(np.int32), w, stride, pad)
    with pytest.raises(ValueError, match="dy shape"):
        conv_gemm.conv3d_backward_data(dy[:, :, :-1], w, x.shape, stride, pad)
    with pytest.raises(ValueError, match="channels"):
        conv_gemm.conv3d_forward(x[:, :2], w, stride, pad)


# ---------------------------------------------------------------------------------------
# settings and cuBLAS math


def test_settings_validate_and_default() -> None:
    with pytest.raises(ValueError, match="algorithm"):
        ConvSettings(algorithm="fft")
    with pytest.raises(ValueError, match="math"):
        ConvSettings(math="bf16")
    with pytest.raises(ValueError, match="cudnn_layout"):
        ConvSettings(cudnn_layout="nhwc")
    with pytest.raises(ValueError, match="gemm_budget_bytes"):
        ConvSettings(gemm_budget_bytes=0)
    with pytest.raises(TypeError, match="ConvSettings"):
        settings.resolve_settings({"algorithm": "gemm"})
    chosen = ConvSettings(algorithm="gemm", math="tf32", gemm_budget_bytes=1 << 20)
    assert settings.resolve_settings(chosen) is chosen
    assert settings.resolve_settings(None) == ConvSettings()
    assert not any(hasattr(settings, name) for name in ("configure", "current", "generation"))


def test_gemm_reads_budget_and_math_from_settings(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(conv_gemm, "gemm_chunks",
                        lambda geo, itemsize, budget: seen.append(budget) or [(0, geo.batch, 0,
                                                                               geo.out[0])])
    x, w, _, stride, pad = make_case(CASES[0])
    conv_gemm.conv3d_forward(x, w, stride, pad, settings=ConvSettings(gemm_budget_bytes=12345))
    conv_gemm.conv3d_forward(x, w, stride, pad)  # no settings: the defaults
    conv_gemm.conv3d_forward(x, w, stride, pad, budget=777,
                             settings=ConvSettings(gemm_budget_bytes=12345))
    assert seen == [12345, ConvSettings().gemm_budget_bytes, 777]


class FakeLinalg:
    """Stand-in for cupy._core._routines_linalg (records the compute-type switches)."""

    COMPUTE_TYPE_DEFAULT, COMPUTE_TYPE_TF32 = 1, 7

    def __init__(self, start: int) -> None:
        self.mode, self.sets = start, []

    def get_compute_type(self, dtype) -> int:
        assert np.dtype(dtype) == np.float32
        return self.mode

    def set_compute_type(self, dtype, mode) -> None:
        self.mode = mode
        self.sets.append(mode)


def test_cublas_math_switches_and_restores(monkeypatch, caplog) -> None:
    with settings.cublas_math(np, True):  # numpy: nothing to switch
        pass
    device = types.SimpleNamespace(compute_capability="90")
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: device))
    linalg = FakeLinalg(start=1)
    monkeypatch.setattr(settings, "_cupy_linalg", lambda: linalg)
    with settings.cublas_math(fake_cupy, True):
        assert linalg.mode == 7
    assert linalg.mode == 1 and linalg.sets == [7, 1]
    with settings.cublas_math(fake_cupy, False):  # already in default math: no switch
        pass
    assert linalg.sets == [7, 1]
    device.compute_capability = "70"  # no TF32 on a V100: stays in default math
    with settings.cublas_math(fake_cupy, True):
        assert linalg.mode == 1
    assert linalg.sets == [7, 1]
    monkeypatch.setattr(settings, "_cupy_linalg", lambda: None)
    monkeypatch.setattr(settings, "_warned_no_switch", False)
    with caplog.at_level(logging.WARNING, logger="cosmotrain.kernels.cuda"):
        for _ in range(2):
            with settings.cublas_math(fake_cupy, True):
                pass
    assert len([r for r in caplog.records if "CUPY_TF32" in r.message]) == 1


# ---------------------------------------------------------------------------------------
# algorithm resolution and dispatch


def test_resolve_algorithm() -> None:
    ok, broken = (lambda: (True, "cuDNN 9")), (lambda: (False, "no CUDA device"))
    assert conv.resolve_algorithm("gemm", broken)[0] == "gemm"
    assert conv.resolve_algorithm("auto", ok) == ("cudnn", "cuDNN 9")
    algo, why = conv.resolve_algorithm("auto", broken)
    assert algo == "gemm" and "no CUDA device" in why
    assert conv.resolve_algorithm("cudnn", ok)[0] == "cudnn"
    with pytest.raises(RuntimeError, match="'cudnn' but no CUDA device"):
        conv.resolve_algorithm("cudnn", broken)


def test_cudnn_status_names_the_packages_when_cudnn_is_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cudnn", None)  # makes `import cudnn` fail
    usable, why = conv.cudnn_status()
    assert not usable and "nvidia-cudnn-frontend" in why


def test_auto_is_resolved_once_per_request_and_logged(monkeypatch, caplog) -> None:
    """The resolution depends on the requested algorithm only: probed and logged once per
    request in a process, whatever the other settings."""
    probes = []
    monkeypatch.setattr(conv, "cudnn_status",
                        lambda: probes.append(1) or (False, "import cudnn failed"))
    with caplog.at_level(logging.INFO, logger="cosmotrain.kernels.cuda"):
        assert conv.algorithm()[0] == "gemm"
        assert conv.algorithm(ConvSettings(algorithm="auto"))[0] == "gemm"
        assert conv.algorithm(ConvSettings(math="tf32", cudnn_layout="ncdhw"))[0] == "gemm"
        assert conv.algorithm(ConvSettings(algorithm="gemm"))[0] == "gemm"  # no probe
        for _ in range(2):  # asked for explicitly: an error on every call, nothing cached
            with pytest.raises(RuntimeError, match="import cudnn failed"):
                conv.algorithm(ConvSettings(algorithm="cudnn"))
    assert len(probes) == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "import cudnn failed" in warnings[0].message
    assert len(caplog.records) == 2  # the auto fallback (warning), gemm as asked (info)


def test_numpy_inputs_take_the_gemm_path(monkeypatch) -> None:
    monkeypatch.setattr(conv, "algorithm",
                        lambda *args: pytest.fail("no resolution for numpy"))
    cudnn = ConvSettings(algorithm="cudnn")
    x, w, dy, stride, pad = make_case(CASES[1])
    for op in OPS:
        np.testing.assert_allclose(run_op(conv, op, x, w, dy, stride, pad, settings=cudnn),
                                   cpu_reference(op, x, w, dy, stride, pad), rtol=1e-12,
                                   atol=1e-11)


# ---------------------------------------------------------------------------------------
# conv_cudnn: pure parts and the wrapper around a reference runner


def test_symmetric_padding_and_extension() -> None:
    sym, extend = conv_cudnn.symmetric_padding(((1, 0), (2, 2), (0, 3)))
    assert sym == (0, 2, 0) and extend == ((1, 0), (0, 0), (0, 3))
    assert conv_cudnn.extended_shape((2, 4, 5, 6, 7), extend) == (2, 4, 6, 6, 10)


@pytest.mark.parametrize("layout", ["ndhwc", "ncdhw"])
def test_layout_strides_describe_the_buffers(layout) -> None:
    dims = (2, 3, 4, 5, 6)
    a = np.arange(math.prod(dims), dtype=np.float32).reshape(dims)
    buf = conv_cudnn.to_layout(np, a, layout)
    strides = conv_cudnn.layout_strides(dims, layout)
    view = as_strided(buf, dims, [s * buf.itemsize for s in strides])
    np.testing.assert_array_equal(view, a)
    np.testing.assert_array_equal(conv_cudnn.from_layout(np, buf, layout), a)
    if layout == "ndhwc":
        assert strides == (360, 1, 90, 18, 3)
    else:
        assert buf is a  # already NCDHW-contiguous: no copy


def test_zero_extension_and_crop_round_trip() -> None:
    a = np.random.default_rng(0).standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    extend = ((1, 0), (0, 2), (2, 1))
    for layout in ("ndhwc", "ncdhw"):
        buf = conv_cudnn.to_layout(np, a, layout, extend)
        full = conv_cudnn.from_layout(np, buf, layout)
        assert full.shape == (1, 2, 4, 6, 8)
        np.testing.assert_array_equal(full, np.pad(a, ((0, 0), (0, 0)) + extend))
        np.testing.assert_array_equal(conv_cudnn.from_layout(np, buf, layout, crop=extend), a)


def test_plan_call_keys_and_note_filters() -> None:
    geo = ConvGeometry.create((2, 4, 9, 8, 7), (16, 4, 3, 3, 3), (2, 1, 1),
                              ((1, 0), (1, 1), (0, 2)))
    call = conv_cudnn.plan_call("dgrad", geo, "float32", "fp32", "ndhwc")
    assert call.padding == (0, 1, 0) and call.extend == ((1, 0), (0, 0), (0, 2))
    assert call.image.dims == (2, 4, 10, 8, 9) and call.output.dims == geo.y_shape
    assert call.image.strides == (2880, 1, 288, 36, 4)
    assert call.key() == conv_cudnn.plan_call("dgrad", geo, "float32", "fp32", "ndhwc").key()
    others = [conv_cudnn.plan_call(op, geo, dtype, m, layout).key()
              for op, dtype, m, layout in [("wgrad", "float32", "fp32", "ndhwc"),
                                           ("dgrad", "bfloat16", "fp32", "ndhwc"),
                                           ("dgrad", "float32", "tf32", "ndhwc"),
                                           ("dgrad", "float32", "fp32", "ncdhw")]]
    assert len(set(others + [call.key()])) == 5
    assert "TENSOR_CORE" in conv_cudnn.note_filters(call)
    tf32 = conv_cudnn.plan_call("fprop", geo, "float32", "tf32", "ndhwc")
    bf16 = conv_cudnn.plan_call("fprop", geo, "bfloat16", "fp32", "ndhwc")
    for relaxed in (tf32, bf16):
        assert conv_cudnn.note_filters(relaxed) == ("DOWN_CONVERT_INPUTS",
                                                    "REDUCED_PRECISION_REDUCTION")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        conv_cudnn.plan_call("fprop", geo, "float64", "fp32", "ndhwc")


def test_graph_cache_builds_once_and_evicts_least_recently_used() -> None:
    cache, built = conv_cudnn.GraphCache(), []

    def build(key):
        return lambda: built.append(key) or f"graph{key}"

    assert cache.get(("a",), build("a"), 2) == "grapha"
    assert cache.get(("b",), build("b"), 2) == "graphb"
    assert cache.get(("a",), build("a"), 2) == "grapha"   # hit; "b" is now the oldest
    cache.get(("c",), build("c"), 2)                       # evicts "b"
    cache.get(("a",), build("a"), 2)
    cache.get(("b",), build("b"), 2)
    assert built == ["a", "b", "c", "b"] and cache.builds == 4 and len(cache) == 2


class ReferenceRunner:
    """Executes a ConvCall with the CPU kernels on the buffers it is given, read and
    written through the call's descriptors (dims + element strides), with the call's
    symmetric padding: what a correct cuDNN graph computes."""

    def __init__(self) -> None:
        self.calls: list = []
        self.cache_sizes: list = []

    def run(self, call, buffers, cache_size=conv_cudnn.DEFAULT_GRAPH_CACHE_SIZE) -> None:
        self.calls.append(call)
        self.cache_sizes.append(cache_size)
        views = {}
        for role, desc in (("x", call.image), ("w", call.filter), ("y", call.output)):
            buf = buffers[role]
            assert buf.flags.c_contiguous and buf.size == math.prod(desc.dims)
            assert buf.dtype.name == call.dtype
            views[role] = as_strided(buf, desc.dims, [s * buf.itemsize for s in desc.strides])
        out = conv_cudnn.OUTPUT_ROLE[call.op]
        x, w, y = (None if r == out else views[r].astype(np.float64) for r in "xwy")
        pad = tuple((p, p) for p in call.padding)
        if call.op == "fprop":
            views[out][...] = conv3d_forward(x, w, call.stride, pad)
        elif call.op == "dgrad":
            views[out][...] = conv3d_backward_data(y, w, call.image.dims, call.stride, pad)
        else:
            views[out][...] = conv3d_backward_filter(x, y, call.filter.dims, call.stride, pad)


@pytest.mark.parametrize("layout", ["ndhwc", "ncdhw"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cudnn_wrappers_translate_layout_and_padding(case, layout) -> None:
    x, w, dy, stride, pad = make_case(case, seed=4, dtype=np.float32)
    runner = ReferenceRunner()
    for op in OPS:
        ours = run_op(conv_cudnn, op, x, w, dy, stride, pad, runner=runner, layout=layout)
        exact = cpu_reference(op, x, w, dy, stride, pad)
        assert ours.dtype == np.float32 and ours.shape == exact.shape
        assert ours.flags.c_contiguous
        assert rel_error(ours, exact) < 1e-6
    sym = tuple(min(p) for p in normalize_padding(pad))
    assert [c.op for c in runner.calls] == list(OPS)
    assert all(c.padding == sym and c.layout == layout for c in runner.calls)


def test_cudnn_wrappers_bfloat16_and_mixed_operands() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x, w, dy, stride, pad = make_case(CASES[1], seed=5, dtype=np.float32)
    runner = ReferenceRunner()
    xb, dyb = x.astype(bf16), dy.astype(bf16)
    for op in OPS:  # w (and dy for wgrad) stays float32: cast to the storage dtype
        ours = run_op(conv_cudnn, op, xb, w, dyb, stride, pad, runner=runner)
        assert ours.dtype == bf16
        assert rel_error(ours, cpu_reference(op, x, w, dy, stride, pad)) < 1e-2
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        conv_cudnn.conv3d_forward(x.astype(np.float64), w, stride, pad, runner=runner)


def test_dispatch_runs_cudnn_and_falls_back_to_gemm(monkeypatch, caplog) -> None:
    """conv.py with cuDNN selected: the call goes to the runner with the math, layout and
    cache size of the settings it was given; a CudnnUnsupported from the runner runs the
    gemm path instead (under the same settings), logged once."""
    runner = ReferenceRunner()
    seen = []
    monkeypatch.setattr(conv, "_uses_cudnn", lambda chosen, *arrays: seen.append(chosen) or True)
    monkeypatch.setattr(conv, "default_runner", lambda: runner)
    chosen = ConvSettings(algorithm="cudnn", math="tf32", cudnn_layout="ndhwc",
                          graph_cache_size=7, cudnn_autotune=True)
    x, w, dy, stride, pad = make_case(CASES[3], seed=6, dtype=np.float32)
    for op in OPS:
        assert rel_error(run_op(conv, op, x, w, dy, stride, pad, settings=chosen),
                         cpu_reference(op, x, w, dy, stride, pad)) < 1e-6
    assert [(c.math, c.layout, c.cudnn_autotune) for c in runner.calls] == [
        ("tf32", "ndhwc", True)] * 3
    assert runner.cache_sizes == [7] * 3 and seen == [chosen] * 3
    run_op(conv, "fprop", x, w, dy, stride, pad)  # no settings: the defaults
    assert (runner.calls[-1].math, runner.calls[-1].layout,
            runner.calls[-1].cudnn_autotune) == ("fp32", "ncdhw", False)
    assert runner.cache_sizes[-1] == ConvSettings().graph_cache_size

    class Unsupported:
        def run(self, call, buffers, cache_size):
            raise conv_cudnn.CudnnUnsupported(f"no engine for {call.op}")

    gemm_settings = []
    gemm_op = conv_gemm.conv3d_forward
    monkeypatch.setattr(conv_gemm, "conv3d_forward", lambda *args, settings: (
        gemm_settings.append(settings) or gemm_op(*args, settings=settings)))
    monkeypatch.setattr(conv, "default_runner", lambda: Unsupported())
    with caplog.at_level(logging.WARNING, logger="cosmotrain.kernels.cuda"):
        for _ in range(2):
            for op in OPS:
                assert rel_error(run_op(conv, op, x, w, dy, stride, pad, settings=chosen),
                                 cpu_reference(op, x, w, dy, stride, pad)) < 1e-5
    assert sorted(r.message.split(";")[0] for r in caplog.records) == [
        "no engine for dgrad", "no engine for fprop", "no engine for wgrad"]
    assert gemm_settings == [chosen] * 2


def test_fastest_plan_skips_plans_that_fail() -> None:
    times = {0: 3.0, 1: RuntimeError("CUDNN_STATUS_EXECUTION_FAILED"), 2: 1.0, 3: 2.0}

    def seconds_of(index):
        if isinstance(times[index], Exception):
            raise times[index]
        return times[index]

    best, failures = cudnn_plans.fastest_plan(4, seconds_of)
    assert best == 2 and list(failures) == [1] and "EXECUTION_FAILED" in failures[1]
    with pytest.raises(conv_cudnn.CudnnUnsupported, match="no plan of 2 ran"):
        cudnn_plans.fastest_plan(2, lambda index: seconds_of(1))


def test_event_seconds_times_the_repeats_after_one_untimed_run() -> None:
    runs, marks = [], []

    class Event:
        def record(self):
            marks.append(len(runs))

        def synchronize(self):
            """Nothing is queued: the stand-in runs each call at once."""

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda start, end: 10.0 * (marks[1] - marks[0])))
    seconds = cudnn_plans.event_seconds(fake, lambda: runs.append(1), repeats=3)
    assert len(runs) == 4 and marks == [1, 4]  # warm run before the first event
    assert seconds == pytest.approx(0.010)  # 30 ms over 3 runs


def test_the_runner_tunes_once_and_remembers_a_graph_with_no_plan(monkeypatch, caplog
                                                                  ) -> None:
    """``CudnnRunner._tune`` times every candidate through ``execute_plan_at_index`` and
    keeps the fastest; when none runs, the key is remembered as unsupported (gemm runs
    it from then on, without another build)."""
    executed = []

    class Graph:
        def execute_plan_at_index(self, pointers, workspace, index, handle=None):
            executed.append(index)
            if index == 0:
                raise RuntimeError("not supported on this device")

        def get_plan_name_at_index(self, index):
            return f"engine{index}"

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace())
    speed = {1: 2e-3, 2: 5e-4, 3: 9e-4}
    monkeypatch.setattr(cudnn_plans, "event_seconds",
                        lambda cupy, run: (run(), speed[executed[-1]])[1])
    geo = ConvGeometry.create((2, 4, 9, 8, 7), (16, 4, 3, 3, 3), 1, 1)
    call = conv_cudnn.plan_call("fprop", geo, "float32", "fp32", "ncdhw", True)
    entry = conv_cudnn.GraphEntry(Graph(), {}, 0, candidates=4)
    runner = conv_cudnn.CudnnRunner()
    assert entry.needs_tuning
    with caplog.at_level(logging.INFO, logger="cosmotrain.kernels.cuda"):
        runner._tune(entry, call, call.key(), {}, 0, None)
    assert entry.plan == 2 and not entry.needs_tuning and executed == [0, 1, 2, 3]
    assert "plan 2 of 4 (engine2); 1 could not run" in caplog.text
    none_runs = conv_cudnn.GraphEntry(Graph(), {}, 0, candidates=1)
    with pytest.raises(conv_cudnn.CudnnUnsupported, match="no plan of 1 ran"):
        runner._tune(none_runs, call, ("key",), {}, 0, None)
    assert "no plan of 1 ran" in runner.unsupported[("key",)]
    with pytest.raises(ValueError, match="cudnn_autotune must be True or False"):
        conv_cudnn.plan_call("fprop", geo, "float32", "fp32", "ncdhw", "fastest")


def test_describe_graph_matches_the_frontend_ir() -> None:
    """The graph handed to cuDNN (frontend IR, no GPU needed): operands, strides, dtype,
    padding and stride as planned."""
    cudnn = pytest.importorskip("cudnn")
    geo = ConvGeometry.create((2, 4, 9, 8, 7), (16, 4, 3, 3, 3), (2, 1, 1),
                              ((1, 0), (1, 1), (0, 2)))
    for op in OPS:
        call = conv_cudnn.plan_call(op, geo, "bfloat16", "fp32", "ndhwc")
        graph, tensors = conv_cudnn.describe_graph(cudnn, call, None)
        kind, padding, stride = graph_node(graph)
        assert kind == {"fprop": "CONV_FPROP", "dgrad": "CONV_DGRAD",
                        "wgrad": "CONV_WGRAD"}[op]
        assert (padding, stride) == ([0, 1, 0], [2, 1, 1])
        for role, desc in (("x", call.image), ("w", call.filter), ("y", call.output)):
            dims, strides, dtype, virtual = tensor_attributes(tensors[role])
            assert (dims, strides) == (desc.dims, desc.strides)
            assert dtype == cudnn.data_type.BFLOAT16
            assert not virtual or role != conv_cudnn.OUTPUT_ROLE[op]


def graph_node(graph) -> tuple:
    """``(type, pre-padding, stride)`` of a one-node graph.  Frontend 1.32 has
    ``graph.inspect()``; 1.20 (the one run on the H200) only the JSON of ``repr``."""
    if hasattr(graph, "inspect"):
        (node,) = graph.inspect()["nodes"]
        return node["type"], node["params"]["padding"], node["params"]["stride"]
    text = repr(graph)
    nodes = json.loads(text)["nodes"]
    assert len(nodes) == 1, text
    return nodes[0]["tag"], nodes[0]["pre_padding"], nodes[0]["stride"]


def tensor_attributes(t) -> tuple:
    """``(dims, strides, data type, virtual)``: properties in frontend 1.32, getters in
    1.20."""
    if hasattr(t, "get_dim"):
        return (tuple(t.get_dim()), tuple(t.get_stride()), t.get_data_type(),
                t.get_is_virtual())
    return tuple(t.dim), tuple(t.stride), t.data_type, t.is_virtual


# ---------------------------------------------------------------------------------------
# benchmarks/bench_gpu.py: the parts that need no GPU


@pytest.fixture(scope="module")
def bench():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_exits_2_without_a_gpu(bench, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--no-torch"])
    assert exit_info.value.code == 2
    assert "needs cupy and a CUDA GPU" in capsys.readouterr().err


def test_bench_gpu_layers_come_from_the_model_and_table(bench) -> None:
    _, layers = bench.cosmoflow_convs(128)
    assert [layer.name for layer in layers] == [f"conv{i}" for i in range(1, 8)]
    assert layers[0].sample_shape == (4, 128, 128, 128) and not layers[0].dgrad
    assert layers[3].stride == (2, 2, 2) and layers[3].sample_shape == (64, 16, 16, 16)
    assert all(layer.dgrad for layer in layers[1:])
    assert layers[0].flops(1) == 2 * 2.0 * 16 * 4 * 27 * 128 ** 3   # fwd + wgrad
    rows = [dict(impl="cosmotrain cudnn", layout="ndhwc", batch=1, precision="fp32",
                 status="ok", samples_per_s=12.34),
            dict(impl="cosmotrain gemm", layout="-", batch=1, precision="fp32",
                 status="out of memory"),
            dict(impl="torch convs", layout="ncdhw", batch=8, precision="bf16", status="ok",
                 samples_per_s=99.0)]
    assert bench.markdown(rows).splitlines() == [
        "| batch | precision | cosmotrain cudnn (ndhwc) | cosmotrain gemm | torch convs |",
        "|---|---|---|---|---|",
        "| 1 | fp32 | 12.3 | out of memory |  |",
        "| 8 | bf16 |  |  | 99.0 |"]


# ---------------------------------------------------------------------------------------
# On a GPU (skipped without cupy and a device)


@pytest.fixture
def cupy():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        pytest.skip(f"no CUDA device: {exc}")
    if count < 1:
        pytest.skip("no CUDA device")
    return cupy


def _device_dtypes():
    """(storage dtype, math, tolerance relative to max |exact|) run on the GPU."""
    out = [(np.dtype(np.float32), "fp32", 1e-5), (np.dtype(np.float32), "tf32", 5e-3)]
    try:
        import ml_dtypes
        out.append((np.dtype(ml_dtypes.bfloat16), "fp32", 1e-2))
    except ImportError:
        pass
    return out


# Channel counts cuDNN's tensor-core engines are aligned for: these must run on cuDNN
# itself (called without the gemm fallback); CASES may fall back, with a warning.
ALIGNED_CASES = [
    (2, 16, 32, (12, 10, 9), 3, 1, ((1, 0), (1, 1), (0, 1))),
    (2, 64, 128, (8, 8, 8), 3, 2, 1),
]


def _device_results(cupy, module, case, storage, **kwargs):
    """((op, ours on the host), ...) and the float64 CPU results of one case."""
    x, w, dy, stride, pad = make_case(case, seed=7)
    xd, wd, dyd = (cupy.asarray(a.astype(storage)) for a in (x, w, dy))
    for op in OPS:
        ours = run_op(module, op, xd, wd, dyd, stride, pad, **kwargs)
        assert isinstance(ours, cupy.ndarray) and ours.dtype == storage
        assert ours.flags.c_contiguous
        yield op, cupy.asnumpy(ours), cpu_reference(op, x, w, dy, stride, pad)


def _check_on_device(cupy, algorithm: str, layout: str = "ndhwc",
                     cudnn_autotune: bool = False) -> None:
    """Every case, op and precision through conv.py against the CPU kernels."""
    for storage, mode, tol in _device_dtypes():
        chosen = ConvSettings(algorithm=algorithm, math=mode, cudnn_layout=layout,
                              cudnn_autotune=cudnn_autotune)
        for case in CASES + ALIGNED_CASES:
            for op, ours, exact in _device_results(cupy, conv, case, storage, settings=chosen):
                assert rel_error(ours, exact) < tol, (case, op, storage.name, mode, layout)
        assert conv.algorithm(chosen)[0] == algorithm


def test_gpu_gemm_matches_cpu_kernels(cupy) -> None:
    _check_on_device(cupy, "gemm")


def test_gpu_cudnn_matches_cpu_kernels(cupy) -> None:
    usable, why = conv.cudnn_status()
    if not usable:
        pytest.skip(why)
    runner = conv.default_runner()
    for layout in ("ndhwc", "ncdhw"):
        for storage, mode, tol in _device_dtypes():
            for case in ALIGNED_CASES:  # no fallback: CudnnUnsupported fails the test
                for op, ours, exact in _device_results(cupy, conv_cudnn, case, storage,
                                                       runner=runner, math=mode,
                                                       layout=layout):
                    assert rel_error(ours, exact) < tol, (case, op, storage.name, mode, layout)
        _check_on_device(cupy, "cudnn", layout)
    if runner.unsupported:
        warnings.warn("cuDNN had no engine for (gemm ran instead): "
                      + "; ".join(sorted(runner.unsupported.values())))


def test_gpu_cudnn_autotuned_plans_match_cpu_kernels(cupy) -> None:
    """Every plan cuDNN lists is timed and the fastest kept; its results are the CPU's
    (the output of the last plan timed is overwritten by the chosen one's)."""
    usable, why = conv.cudnn_status()
    if not usable:
        pytest.skip(why)
    _check_on_device(cupy, "cudnn", "ncdhw", cudnn_autotune=True)


def test_gpu_cudnn_graphs_are_cached_and_follow_the_stream(cupy) -> None:
    usable, why = conv.cudnn_status()
    if not usable:
        pytest.skip(why)
    cudnn = ConvSettings(algorithm="cudnn")
    x, w, _, stride, pad = make_case(ALIGNED_CASES[0], seed=8)
    xd, wd = cupy.asarray(x.astype(np.float32)), cupy.asarray(w.astype(np.float32))
    first = conv.conv3d_forward(xd, wd, stride, pad, settings=cudnn)
    builds = conv.default_runner().cache.builds
    cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        again = conv.conv3d_forward(xd, wd, stride, pad, settings=cudnn)
    stream.synchronize()
    assert conv.default_runner().cache.builds == builds
    cupy.testing.assert_array_equal(first, again)


def test_gpu_conv1_padded_to_8_channels_matches_unpadded(cupy) -> None:
    """``conv1_channels_pad: 8`` (kernels/cuda/conv1.py) on cuDNN: conv1's forward and
    weight gradient on 4 channels padded to 8 give the unpadded results."""
    usable, why = conv.cudnn_status()
    if not usable:
        pytest.skip(why)
    rng = np.random.default_rng(5)
    for storage, mode, tol in _device_dtypes():
        x, w, dy = (cupy.asarray(rng.normal(size=shape).astype(np.float32).astype(storage))
                    for shape in ((2, 4, 12, 12, 12), (16, 4, 3, 3, 3), (2, 16, 12, 12, 12)))
        plain = ConvSettings(algorithm="cudnn", math=mode)
        padded = ConvSettings(algorithm="cudnn", math=mode, conv1_channels_pad=8)
        for op, args in (("conv3d_forward", (x, w, 1, 1)),
                         ("conv3d_backward_filter", (x, dy, w.shape, 1, 1))):
            want = cupy.asnumpy(getattr(conv, op)(*args, settings=plain))
            got = cupy.asnumpy(getattr(conv, op)(*args, settings=padded))
            assert got.shape == want.shape
            assert rel_error(got, want.astype(np.float64)) < tol, (op, storage.name, mode)
