"""conv3d kernels against independent references.

Forward: a direct-loop numpy convolution (explicit loops over output positions and kernel
offsets, float64).  Gradients: central finite differences of ``sum(conv(x, w) * r)`` in
float64 on random entries, and dot tests (``<conv(x), r> = <x, dgrad(r)>`` and the same in
``w``) on whole tensors.  Every case runs under several lowering / chunking / threading
policies so that each code path (plain im2col, W-split, H-and-W split, depth windows,
strided slab, col2im scatter; one or many chunks; one or two workers) meets the
references.  PyTorch, when installed, is a second oracle at moderate size.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cosmotrain.kernels.cpu import workers as _parallel, depth_lowering
from cosmotrain.kernels.cpu import conv_gemm
from cosmotrain.kernels.conv3d import (conv3d_backward_data, conv3d_backward_filter,
                                       conv3d_forward)
from cosmotrain.kernels.geometry import normalize_padding

# N, C, F, spatial, kernel, stride, padding
CASES = [
    (2, 3, 5, (7, 6, 5), 3, 1, 1),
    (1, 4, 7, (9, 8, 10), (2, 3, 4), (2, 1, 2), ((1, 0), (0, 2), (2, 1))),
    (3, 2, 3, (5, 5, 6), (5, 1, 2), (1, 2, 3), ((0, 0), (0, 0), (1, 1))),
    (2, 5, 4, (6, 7, 8), 1, 1, 0),
    (1, 3, 2, (8, 6, 7), 2, 2, 0),                                   # halo-style: no padding
    (2, 2, 3, (6, 5, 9), 4, 1, ((3, 0), (1, 2), (0, 3))),
    (1, 3, 4, (7, 8, 6), 5, 1, ((2, 2), (4, 0), (0, 1))),
    (2, 3, 2, (5, 6, 7), 3, 1, ((1, 0), (0, 2), (2, 1))),
    (1, 2, 3, (8, 7, 9), 2, 3, ((0, 1), (1, 0), (0, 0))),            # stride > kernel
    (1, 2, 2, (3, 4, 3), 2, 1, ((2, 0), (0, 3), (1, 1))),            # padding >= kernel
]
IDS = [f"case{i}" for i in range(len(CASES))]

# (split waste allowed, chunks per sample, GEMM buffer bytes, workers, forward / filter
# gradient algorithm): plain or split lowerings; one plane per chunk and per GEMM, or
# whole samples in one GEMM; 1 or 2 threads; depth windows (one output row per GEMM and
# one plane per chunk, or whole planes and samples) instead of the lowerings; the data
# gradient of unsplit layers with F > C or few outputs scatters (col2im, DGRAD_SCATTER,
# SCATTER_MAX_OUTPUTS) except under "gather", whose GEMMs take several planes
# (MIN_GEMM_COLUMNS)
POLICIES = {
    "plain-planes-2w": (0.0, 1 << 10, 1, 2, "lowering"),
    "split-planes-2w": (10.0, 1 << 10, 1, 2, "lowering"),
    "split-whole-1w": (10.0, 1, 1 << 30, 1, "lowering"),
    "plain-whole-2w": (0.0, 1, 1 << 30, 2, "lowering"),
    "windows-rows-2w": (0.0, 1 << 10, 1, 2, "windows"),
    "windows-whole-1w": (0.0, 1, 1 << 30, 1, "windows"),
    "plain-gather-2w": (0.0, 1 << 10, 1, 2, "gather"),
}


@pytest.fixture(params=list(POLICIES))
def policy(request, monkeypatch):
    waste, chunks, budget, workers, algorithm = POLICIES[request.param]
    monkeypatch.setattr(conv_gemm, "MAX_SPLIT_WASTE", waste)
    monkeypatch.setattr(conv_gemm, "CHUNKS_PER_SAMPLE", chunks)
    monkeypatch.setattr(conv_gemm, "MIN_COLUMNS", 1)
    monkeypatch.setattr(conv_gemm, "CHUNK_BYTES", budget)
    # "gather": groups of several planes through MIN_GEMM_COLUMNS despite the 1-byte budget
    monkeypatch.setattr(conv_gemm, "MIN_GEMM_COLUMNS", 100 if algorithm == "gather" else 1)
    monkeypatch.setattr(conv_gemm, "SCATTER_BYTES", budget)
    monkeypatch.setattr(conv_gemm, "DGRAD_SCATTER", algorithm != "gather")
    if algorithm == "gather":  # small cases would otherwise scatter (SCATTER_MAX_OUTPUTS)
        monkeypatch.setattr(conv_gemm, "SCATTER_MAX_OUTPUTS", 0)
    monkeypatch.setattr(conv_gemm, "MIN_WINDOW_PLANE", 1 if algorithm == "windows" else 1 << 30)
    monkeypatch.setattr(conv_gemm, "MAX_WINDOW_CHANNELS", 1 << 30)
    monkeypatch.setattr(depth_lowering, "CHUNK_PLANES", 1 if chunks > 1 else 1 << 10)
    monkeypatch.setattr(depth_lowering, "COLS_BYTES", budget)
    _parallel.set_num_workers(workers)
    yield request.param
    _parallel.set_num_workers(None)


def reference_conv3d(x, w, stride, padding) -> np.ndarray:
    """Direct loops over output positions and kernel offsets (float64, zero padding)."""
    stride = (stride,) * 3 if isinstance(stride, int) else tuple(stride)
    pad = normalize_padding(padding)
    xp = np.pad(np.asarray(x, np.float64), ((0, 0), (0, 0)) + pad)
    kd, kh, kw = w.shape[2:]
    out = [(xp.shape[2 + i] - w.shape[2 + i]) // stride[i] + 1 for i in range(3)]
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for d, h, v in itertools.product(*map(range, out)):
        for a, b, e in itertools.product(range(kd), range(kh), range(kw)):
            patch = xp[:, :, d * stride[0] + a, h * stride[1] + b, v * stride[2] + e]  # (N, C)
            y[:, :, d, h, v] += patch @ w[:, :, a, b, e].T
    return y


def _data(case, seed=0):
    n, c, f, spatial, k, stride, pad = case
    k = (k,) * 3 if isinstance(k, int) else k
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, c) + spatial), rng.standard_normal((f, c) + k), stride, pad


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_matches_direct_loops(case, policy) -> None:
    x, w, stride, pad = _data(case)
    expected = reference_conv3d(x, w, stride, pad)
    np.testing.assert_allclose(conv3d_forward(x, w, stride, pad), expected, rtol=1e-12, atol=1e-12)
    y32 = conv3d_forward(x.astype(np.float32), w.astype(np.float32), stride, pad)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def _finite_difference(loss, a: np.ndarray, index, eps: float = 1e-3) -> float:
    up, down = a.copy(), a.copy()
    up[index] += eps
    down[index] -= eps
    return (loss(up) - loss(down)) / (2 * eps)


_FD_CACHE: dict = {}


def finite_differences(case, wrt: str, count: int = 5):
    """[(index, d sum(reference_conv3d * r) / d entry)] for random entries of x or w.

    Computed once per case (the policies only change the kernels under test).
    """
    key = (CASES.index(case), wrt)
    if key not in _FD_CACHE:
        x, w, stride, pad = _data(case)
        r = np.random.default_rng(1).standard_normal(reference_conv3d(x, w, stride, pad).shape)
        a = x if wrt == "x" else w
        loss = ((lambda v: np.vdot(reference_conv3d(v, w, stride, pad), r)) if wrt == "x"
                else (lambda v: np.vdot(reference_conv3d(x, v, stride, pad), r)))
        picks = np.random.default_rng(2).choice(a.size, min(count, a.size), replace=False)
        indices = [np.unravel_index(i, a.shape) for i in picks]
        _FD_CACHE[key] = [(i, _finite_difference(loss, a, i)) for i in indices]
    return _FD_CACHE[key]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_data_gradient(case, policy) -> None:
    x, w, stride, pad = _data(case)
    r = np.random.default_rng(1).standard_normal(conv3d_forward(x, w, stride, pad).shape)
    dx = conv3d_backward_data(r, w, x.shape, stride, pad)
    assert dx.shape == x.shape
    assert np.vdot(conv3d_forward(x, w, stride, pad), r) == pytest.approx(np.vdot(x, dx), rel=1e-11)
    for index, fd in finite_differences(case, "x"):
        assert dx[index] == pytest.approx(fd, rel=1e-7, abs=1e-8)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_filter_gradient(case, policy) -> None:
    x, w, stride, pad = _data(case)
    r = np.random.default_rng(1).standard_normal(conv3d_forward(x, w, stride, pad).shape)
    dw = conv3d_backward_filter(x, r, w.shape, stride, pad)
    assert dw.shape == w.shape and dw.flags.c_contiguous
    assert np.vdot(conv3d_forward(x, w, stride, pad), r) == pytest.approx(np.vdot(w, dw), rel=1e-11)
    for index, fd in finite_differences(case, "w"):
        assert dw[index] == pytest.approx(fd, rel=1e-7, abs=1e-8)


def test_cosmoflow_like_float32_against_float64() -> None:
    """Default policy (W split, real chunking, worker pool) on a thin layer, float32."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 4, 12, 10, 40)).astype(np.float32)
    w = rng.standard_normal((6, 4, 3, 3, 3)).astype(np.float32)
    r = rng.standard_normal((2, 6, 12, 10, 40)).astype(np.float32)
    x64, w64, r64 = (a.astype(np.float64) for a in (x, w, r))
    for ours, exact in [
        (conv3d_forward(x, w, 1, 1), conv3d_forward(x64, w64, 1, 1)),
        (conv3d_backward_data(r, w, x.shape, 1, 1), conv3d_backward_data(r64, w64, x.shape, 1, 1)),
        (conv3d_backward_filter(x, r, w.shape, 1, 1),
         conv3d_backward_filter(x64, r64, w.shape, 1, 1)),
    ]:
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, exact, rtol=1e-4, atol=2e-5 * np.abs(exact).max())


def test_out_buffers_and_determinism() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 3, 9, 8, 36)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3, 3)).astype(np.float32)
    y = np.full((1, 5, 9, 8, 36), np.nan, np.float32)
    assert conv3d_forward(x, w, 1, 1, out=y) is y
    np.testing.assert_array_equal(y, conv3d_forward(x, w, 1, 1))
    dx = np.full(x.shape, np.nan, np.float32)
    assert conv3d_backward_data(y, w, x.shape, 1, 1, out=dx) is dx
    np.testing.assert_array_equal(dx, conv3d_backward_data(y, w, x.shape, 1, 1))
    _parallel.set_num_workers(2)
    try:  # partials are summed in chunk order, whatever the thread schedule
        runs = [conv3d_backward_filter(x, y, w.shape, 1, 1) for _ in range(3)]
    finally:
        _parallel.set_num_workers(None)
    assert all(np.array_equal(runs[0], run) for run in runs[1:])
    with pytest.raises(ValueError, match="out must be"):
        conv3d_forward(x, w, 1, 1, out=np.empty((1, 5, 9, 8, 35), np.float32))


def test_worker_errors_propagate_and_blas_threads_restored() -> None:
    before = _parallel.num_workers()
    _parallel.set_num_workers(2)

    def work(chunk):
        if chunk == 3:
            raise RuntimeError("boom")
        return chunk * 2

    try:
        assert _parallel.map_chunks(work, [0, 1, 2]) == [0, 2, 4]
        with pytest.raises(RuntimeError, match="boom"):
            _parallel.map_chunks(work, list(range(6)))
    finally:
        _parallel.set_num_workers(None)
    assert _parallel.num_workers() == before


@pytest.mark.parametrize("bad, message", [
    (dict(x=(1, 3, 5, 5, 5), w=(2, 4, 3, 3, 3)), "channels"),
    (dict(x=(1, 3, 2, 5, 5), w=(2, 3, 3, 3, 3)), "smaller than the kernel"),
    (dict(x=(1, 3, 5, 5), w=(2, 3, 3, 3, 3)), "x shape"),
    (dict(x=(1, 3, 5, 5, 5), w=(2, 3, 3, 3)), "w shape"),
    (dict(x=(1, 3, 5, 5, 5), w=(2, 3, 3, 3, 3), padding=(1, 1)), "padding"),
    (dict(x=(1, 3, 5, 5, 5), w=(2, 3, 3, 3, 3), padding=-1), "padding"),
    (dict(x=(1, 3, 5, 5, 5), w=(2, 3, 3, 3, 3), stride=0), "stride"),
])
def test_inconsistent_shapes_raise(bad, message) -> None:
    x, w = np.zeros(bad["x"]), np.zeros(bad["w"])
    with pytest.raises(ValueError, match=message):
        conv3d_forward(x, w, bad.get("stride", 1), bad.get("padding", 0))


def test_gradient_shape_and_dtype_errors() -> None:
    x, w = np.zeros((1, 3, 5, 5, 5)), np.zeros((2, 3, 3, 3, 3))
    with pytest.raises(ValueError, match="dy shape"):
        conv3d_backward_data(np.zeros((1, 2, 5, 5, 4)), w, x.shape, 1, 1)
    with pytest.raises(ValueError, match="dy shape"):
        conv3d_backward_filter(x, np.zeros((1, 2, 3, 3, 3)), w.shape, 1, 1)
    with pytest.raises(ValueError, match="floating"):
        conv3d_forward(x.astype(np.int32), w, 1, 1)


def test_padding_forms() -> None:
    assert normalize_padding(1) == ((1, 1),) * 3
    assert normalize_padding((0, 1, 2)) == ((0, 0), (1, 1), (2, 2))
    assert normalize_padding([(1, 0), (0, 2), [2, 1]]) == ((1, 0), (0, 2), (2, 1))


@pytest.mark.parametrize("stride, pad", [(1, ((1, 1),) * 3), (2, ((1, 1),) * 3),
                                         (1, ((1, 0), (0, 2), (2, 1)))])
def test_against_torch(stride, pad) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 4, 18, 20, 36)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 3, 3)).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_()
    wt = torch.from_numpy(w).requires_grad_()
    torch_pad = [v for lo_hi in reversed(pad) for v in lo_hi]  # F.pad: last dim first
    yt = torch.nn.functional.conv3d(torch.nn.functional.pad(xt, torch_pad), wt, stride=stride)
    r = rng.standard_normal(tuple(yt.shape)).astype(np.float32)
    yt.backward(torch.from_numpy(r))
    for ours, theirs in [(conv3d_forward(x, w, stride, pad), yt.detach().numpy()),
                         (conv3d_backward_data(r, w, x.shape, stride, pad), xt.grad.numpy()),
                         (conv3d_backward_filter(x, r, w.shape, stride, pad), wt.grad.numpy())]:
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("shape, thin", [((2, 3, 6, 5, 40), True), ((1, 20, 5, 6, 7), False)])
def test_bias_is_the_same_add_as_afterwards(monkeypatch, shape, thin) -> None:
    """The bias added in the kernel's chunks gives the bits of ``y += bias`` afterwards,
    in the depth-window and the lowering paths; shape errors name the bias."""
    monkeypatch.setattr(conv_gemm, "MIN_WINDOW_PLANE", 1 if thin else 1 << 30)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((6, shape[1], 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    expected = conv3d_forward(x, w, 1, 1)
    expected += b.reshape(1, -1, 1, 1, 1)
    np.testing.assert_array_equal(conv3d_forward(x, w, 1, 1, bias=b), expected)
    with pytest.raises(ValueError, match="bias shape"):
        conv3d_forward(x, w, 1, 1, bias=b[:5])
