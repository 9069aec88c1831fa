"""Pooling against direct loops (forward), exact adjoints and finite differences (backward).

Average pooling is linear: its backward is checked by a dot test on whole tensors and by
central differences on random entries.  Max pooling is piecewise linear: away from ties
central differences of ``sum(maxpool(x) * r)`` are exact, so the routed gradient is
compared with them.  Cases cover stride 1 and 2+, odd and even kernels, asymmetric padding
and several channel blocks on two workers; PyTorch is a second oracle when installed.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest

from cosmotrain.kernels.cpu import workers as _parallel, maxpool_tiled
from cosmotrain.kernels.compiled import avgpool as avgpool_compiled
from cosmotrain.kernels import pool3d, pool_geometry
from cosmotrain.kernels.pool3d import (avg_pool3d_backward, avg_pool3d_forward,
                                       max_pool3d_backward, max_pool3d_forward)

CASES = [  # kernel, stride, padding ((lo, hi) per dim), spatial shape
    ((3, 3, 3), (2, 2, 2), ((1, 1),) * 3, (7, 6, 5)),            # CosmoFlow's k3 s2 p1
    ((2, 2, 2), (2, 2, 2), ((0, 0),) * 3, (6, 5, 4)),            # MLPerf's k2 s2
    ((3, 3, 3), (1, 1, 1), ((1, 1),) * 3, (4, 5, 6)),            # stride 1
    ((3, 2, 1), (1, 2, 1), ((1, 0), (0, 1), (0, 0)), (5, 6, 3)),
    ((3, 3, 3), (2, 1, 3), ((2, 1), (1, 2), (0, 1)), (4, 5, 7)),
    ((4, 2, 5), (3, 1, 2), ((1, 2), (1, 0), (4, 0)), (9, 4, 8)),
    ((1, 1, 1), (2, 3, 1), ((0, 0),) * 3, (5, 7, 4)),
    # rows long enough for the compiled stride-2 spread's interior pairs (even and odd W)
    ((3, 3, 3), (2, 2, 2), ((1, 1),) * 3, (4, 5, 20)),
    ((3, 2, 5), (2, 2, 2), ((1, 1), (0, 1), (2, 1)), (3, 4, 21)),
]
IDS = [f"case{i}" for i in range(len(CASES))]


@pytest.fixture(params=["whole", "planes-2w"])
def blocks(request, monkeypatch):
    """Whole small volumes in one block, or plane by plane, one channel per block, 2 workers
    (for tiled 2x2x2 max pooling: one channel and one output plane per block)."""
    if request.param == "planes-2w":
        monkeypatch.setattr(pool_geometry, "WHOLE_BYTES", 0)
        monkeypatch.setattr(pool_geometry, "BLOCK_BYTES", 1)
        monkeypatch.setattr(maxpool_tiled, "BLOCK_BYTES", 1)
        _parallel.set_num_workers(2)
    yield request.param
    _parallel.set_num_workers(None)


def reference(x: np.ndarray, kernel, stride, padding, mode: str) -> np.ndarray:
    """Direct loops over output positions; zero padding counted (avg), -inf (max)."""
    fill = 0.0 if mode == "avg" else -np.inf
    padded = np.pad(x, ((0, 0), (0, 0)) + tuple(padding), constant_values=fill)
    out = [(padded.shape[2 + d] - kernel[d]) // stride[d] + 1 for d in range(3)]
    y = np.empty(x.shape[:2] + tuple(out))
    for i, j, l in product(*map(range, out)):
        window = padded[:, :, i * stride[0]:i * stride[0] + kernel[0],
                        j * stride[1]:j * stride[1] + kernel[1],
                        l * stride[2]:l * stride[2] + kernel[2]]
        y[:, :, i, j, l] = (window.mean(axis=(2, 3, 4)) if mode == "avg"
                            else window.max(axis=(2, 3, 4)))
    return y


def _central(loss, x: np.ndarray, index, eps: float) -> float:
    up, down = x.copy(), x.copy()
    up[index] += eps
    down[index] -= eps
    return (loss(up) - loss(down)) / (2 * eps)


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES, ids=IDS)
def test_avg_pool_forward_and_gradient(kernel, stride, padding, shape, blocks) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3) + shape)
    y = avg_pool3d_forward(x, kernel, stride, padding)
    np.testing.assert_allclose(y, reference(x, kernel, stride, padding, "avg"), rtol=1e-12,
                               atol=1e-14)
    r = rng.normal(size=y.shape)
    dx = avg_pool3d_backward(r, x.shape, kernel, stride, padding)
    assert dx.shape == x.shape
    assert (y * r).sum() == pytest.approx((x * dx).sum(), rel=1e-12)  # linear: exact adjoint
    loss = lambda v: float((reference(v, kernel, stride, padding, "avg") * r).sum())  # noqa: E731
    for flat in rng.choice(x.size, 5, replace=False):
        index = np.unravel_index(flat, x.shape)
        assert dx[index] == pytest.approx(_central(loss, x, index, 1e-3), abs=1e-9)


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES, ids=IDS)
def test_max_pool_forward_and_gradient(kernel, stride, padding, shape, blocks) -> None:
    rng = np.random.default_rng(1)
    x = rng.permutation(np.prod((2, 3) + shape)).reshape((2, 3) + shape) * 0.01  # no ties
    y, argmax = max_pool3d_forward(x, kernel, stride, padding)
    assert np.array_equal(y, reference(x, kernel, stride, padding, "max"))
    assert argmax.dtype == np.int8 and argmax.shape == y.shape
    assert argmax.min() >= 0 and argmax.max() < np.prod(kernel)
    r = rng.normal(size=y.shape)
    dx = max_pool3d_backward(r, argmax, x.shape, kernel, stride, padding)
    eps = 1e-4  # piecewise linear: central differences are exact away from ties
    loss = lambda v: float((reference(v, kernel, stride, padding, "max") * r).sum())  # noqa: E731
    for index in list(np.ndindex(x.shape))[::5]:
        assert dx[index] == pytest.approx(_central(loss, x, index, eps), abs=1e-8)


def test_max_pool_ties_pick_first_offset_and_nan_propagates() -> None:
    x = np.zeros((1, 1, 4, 4, 4))
    y, argmax = max_pool3d_forward(x, 2, 2, 0)
    assert np.all(y == 0) and np.all(argmax == 0)  # first offset of each window, like torch
    y, argmax = max_pool3d_forward(x, 3, 1, 1)     # padding (-inf) never wins
    assert np.all(y == 0)
    assert argmax[0, 0, 0, 0, 0] == (1 * 3 + 1) * 3 + 1 and argmax[0, 0, 1, 1, 1] == 0
    x[0, 0, 1, 2, 3] = np.nan
    y, _ = max_pool3d_forward(x, 2, 2, 0)
    assert np.isnan(y[0, 0, 0, 1, 1]) and np.isnan(y).sum() == 1


def test_large_window_uses_int16_offsets() -> None:
    x = np.random.default_rng(2).normal(size=(1, 2, 6, 6, 6))
    y, argmax = max_pool3d_forward(x, 6, 1, 0)
    assert argmax.dtype == np.int16
    assert y[0, 1, 0, 0, 0] == x[0, 1].max()
    assert x[0, 1].flat[argmax[0, 1, 0, 0, 0]] == x[0, 1].max()


def test_float32_stays_float32_cosmoflow_pool() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 4, 20, 18, 32)).astype(np.float32)
    y = avg_pool3d_forward(x, 3, 2, 1)
    assert y.dtype == np.float32 and y.shape == (1, 4, 10, 9, 16)
    np.testing.assert_allclose(y, avg_pool3d_forward(x.astype(np.float64), 3, 2, 1), rtol=1e-5,
                               atol=1e-6)
    dx = avg_pool3d_backward(y, x.shape, 3, 2, 1)
    assert dx.dtype == np.float32
    assert max_pool3d_forward(x, 2, 2, 0)[0].dtype == np.float32


def test_shape_errors() -> None:
    x_shape = (1, 2, 6, 6, 6)
    with pytest.raises(ValueError, match="dy shape"):
        avg_pool3d_backward(np.zeros((1, 2, 3, 3, 2)), x_shape, 3, 2, 1)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        avg_pool3d_forward(np.zeros((1, 2, 2, 6, 6)), 3, 2, 0)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        max_pool3d_forward(np.zeros(x_shape), 2, 2, ((0, 2), (0, 0), (0, 0)))
    with pytest.raises(ValueError, match="argmax shape"):
        max_pool3d_backward(np.zeros((1, 2, 3, 3, 3)), np.zeros((1, 2, 3, 3), np.int8),
                            x_shape, 2, 2, 0)


@pytest.mark.parametrize("kernel, stride, pad", [(3, 2, 1), (2, 2, 0), (3, 1, 1)])
def test_against_torch(kernel, stride, pad) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 3, 9, 10, 12)).astype(np.float32)
    x[:, :, ::2] = 0.0  # ties, like ReLU outputs
    xt = torch.from_numpy(x).requires_grad_()
    r = None
    for mode in ("avg", "max"):
        if mode == "avg":
            yt = torch.nn.functional.avg_pool3d(xt, kernel, stride, pad, count_include_pad=True)
            y = avg_pool3d_forward(x, kernel, stride, pad)
        else:
            yt = torch.nn.functional.max_pool3d(xt, kernel, stride, pad)
            y, argmax = max_pool3d_forward(x, kernel, stride, pad)
        r = rng.normal(size=tuple(yt.shape)).astype(np.float32)
        xt.grad = None
        yt.backward(torch.from_numpy(r))
        dx = (avg_pool3d_backward(r, x.shape, kernel, stride, pad) if mode == "avg"
              else max_pool3d_backward(r, argmax, x.shape, kernel, stride, pad))
        np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 6, 6, 8), (1, 2, 7, 5, 9), (1, 1, 2, 2, 2)])
@pytest.mark.parametrize("block", [1, 1 << 20])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_tiled_max_pool_is_the_general_kernel_bit_for_bit(monkeypatch, shape, block,
                                                           compiled) -> None:
    """2x2x2 windows that tile the input take ``maxpool_tiled`` (its compiled loops, or
    its numpy passes): maxima, offsets and gradients are the general kernel's, ties, NaN
    windows and non-finite gradients included (odd sizes leave a plane, row and column
    in no window)."""
    if compiled and maxpool_tiled._loops() is None:
        pytest.skip("the compiled loops were not built")
    monkeypatch.setattr(maxpool_tiled, "USE_COMPILED", compiled)
    rng = np.random.default_rng(8)
    x = rng.normal(size=shape).astype(np.float32)
    x[:, :, ::2] = np.maximum(x[:, :, ::2], 0)  # ties at 0, like ReLU outputs
    x[0, 0, 1, 1, 1] = np.nan
    monkeypatch.setattr(maxpool_tiled, "BLOCK_BYTES", block)
    _parallel.set_num_workers(2)
    try:
        y, argmax = max_pool3d_forward(x, 2, 2, 0)
        dy = rng.normal(size=y.shape).astype(np.float32)
        dy[0, -1, 0, 0, 0] = np.inf
        dx = max_pool3d_backward(dy, argmax, x.shape, 2, 2, 0)
        monkeypatch.setattr(maxpool_tiled, "applies", lambda *args: False)
        y0, argmax0 = max_pool3d_forward(x, 2, 2, 0)
        dx0 = max_pool3d_backward(dy, argmax0, x.shape, 2, 2, 0)
    finally:
        _parallel.set_num_workers(None)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(argmax, argmax0)
    np.testing.assert_array_equal(dx, dx0)
    assert np.isnan(y).any() and np.isinf(dx).any()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_tiled_max_pool_ties_everywhere_keep_the_first_offset(monkeypatch, compiled) -> None:
    """Windows of three values only (ties between rows, columns and both; rows of 140
    outputs: more than one span of the compiled loops): the first of equal maxima in
    offset order, as the general kernel, and each gradient at that offset."""
    if compiled and maxpool_tiled._loops() is None:
        pytest.skip("the compiled loops were not built")
    monkeypatch.setattr(maxpool_tiled, "USE_COMPILED", compiled)
    x = np.random.default_rng(9).integers(0, 3, size=(1, 2, 4, 6, 280)).astype(np.float32)
    y, argmax = max_pool3d_forward(x, 2, 2, 0)
    dy = np.random.default_rng(10).normal(size=y.shape).astype(np.float32)
    dx = max_pool3d_backward(dy, argmax, x.shape, 2, 2, 0)
    monkeypatch.setattr(maxpool_tiled, "applies", lambda *args: False)
    y0, argmax0 = max_pool3d_forward(x, 2, 2, 0)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(argmax, argmax0)
    np.testing.assert_array_equal(dx, max_pool3d_backward(dy, argmax0, x.shape, 2, 2, 0))


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES, ids=IDS)
@pytest.mark.parametrize("max_planes", [1, 2, 5])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_pooling_in_slabs_of_planes_is_one_call_bit_for_bit(monkeypatch, kernel, stride,
                                                            padding, shape, max_planes,
                                                            dtype) -> None:
    """A volume the kernels pool plane by plane (``pools_by_planes``) pooled in slabs of
    input planes with ``by_planes`` gives exactly the one call's outputs and argmax: the
    spatial layer pools its extended block so, without a copy of the whole block
    (float32 average pooling: the compiled loops, where built)."""
    from cosmotrain.tensor.windows import plane_runs

    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 3) + shape).astype(dtype)
    # the whole volume just over the threshold: without by_planes, every slab would be
    # reduced whole, in another order of the taps (different bits in some cases)
    monkeypatch.setattr(pool_geometry, "WHOLE_BYTES", x[0, 0].nbytes - 1)
    assert pool3d.pools_by_planes(x.shape, x)
    assert not pool3d.pools_by_planes(x[:, :, 1:].shape, x)
    for mode in ("avg", "max"):
        def pool(block, pads, **flags):
            if mode == "avg":
                return avg_pool3d_forward(block, kernel, stride, pads, **flags), None
            return max_pool3d_forward(block, kernel, stride, pads, **flags)

        y0, arg0 = pool(x, padding)
        runs = plane_runs(y0.shape[2], shape[0], kernel[0], stride[0], padding[0][0],
                          max_planes)
        parts = [pool(x[:, :, lo:hi], (pads,) + padding[1:], by_planes=True)
                 for _, (lo, hi), pads in runs]
        np.testing.assert_array_equal(np.concatenate([y for y, _ in parts], axis=2), y0)
        if mode == "max":
            np.testing.assert_array_equal(np.concatenate([a for _, a in parts], axis=2), arg0)


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES, ids=IDS)
def test_compiled_avg_pool_float32(kernel, stride, padding, shape, blocks) -> None:
    """float32 average pooling through the compiled loops against the float64 reference
    (forward) and the float64 numpy kernel (backward), bit for bit the float32 numpy
    kernel (whole volumes or plane by plane, per the ``blocks`` fixture), and the adjoint
    identity."""
    if not avgpool_compiled.applies(np.zeros(1, np.float32)):
        pytest.skip("the compiled loops were not built")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3) + shape)
    y = avg_pool3d_forward(x.astype(np.float32), kernel, stride, padding)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, reference(x, kernel, stride, padding, "avg"), rtol=1e-5,
                               atol=1e-6)
    avgpool_compiled.USE_COMPILED = False
    try:
        np.testing.assert_array_equal(
            y, avg_pool3d_forward(x.astype(np.float32), kernel, stride, padding))
    finally:
        avgpool_compiled.USE_COMPILED = True
    r = rng.normal(size=y.shape)
    dx = avg_pool3d_backward(r.astype(np.float32), x.shape, kernel, stride, padding)
    assert dx.dtype == np.float32 and dx.shape == x.shape
    np.testing.assert_allclose(dx, avg_pool3d_backward(r, x.shape, kernel, stride, padding),
                               rtol=1e-5, atol=1e-6)
    avgpool_compiled.USE_COMPILED = False  # the numpy kernel's float32 bits, same path
    try:
        np.testing.assert_array_equal(
            dx, avg_pool3d_backward(r.astype(np.float32), x.shape, kernel, stride, padding))
    finally:
        avgpool_compiled.USE_COMPILED = True
    assert float((y * r).sum()) == pytest.approx(float((x * dx).sum()), rel=1e-5)


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES, ids=IDS)
def test_streamed_avg_pool_gradient_is_the_plain_stores_bit_for_bit(
        kernel, stride, padding, shape, blocks, monkeypatch) -> None:
    """Gradients past ``avgpool_compiled.STREAM_BYTES`` are finished row by row and copied
    past the caches: the same bits as the plain stores, for rows of whole vectors (20 and
    4 wide here) and others (plain copies then)."""
    if not avgpool_compiled.applies(np.zeros(1, np.float32)):
        pytest.skip("the compiled pooling loops are not built")
    x_shape = (2, 3) + shape
    y_shape = avg_pool3d_forward(np.zeros(x_shape, np.float32), kernel, stride, padding).shape
    dy = np.random.default_rng(4).standard_normal(y_shape).astype(np.float32)
    results = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(avgpool_compiled, "STREAM_BYTES", threshold)
        results.append(avg_pool3d_backward(dy, x_shape, kernel, stride, padding))
    np.testing.assert_array_equal(results[1], results[0])
