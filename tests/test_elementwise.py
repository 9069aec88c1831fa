"""Element-wise kernels: activation, batch norm (split at its reductions), dropout,
linear, losses and per-channel (bias gradient) sums, against direct formulas and finite
differences."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels import activation
from cosmotrain.kernels.cpu import channel_sums as channel_sums_module
from cosmotrain.kernels.activation import leaky_relu_backward, leaky_relu_forward
from cosmotrain.kernels.cpu.channel_sums import channel_sums
from cosmotrain.kernels.batchnorm import (bn_backward_apply, bn_backward_local_sums,
                                          bn_local_sums, bn_normalize, bn_statistics)
from cosmotrain.kernels.dropout import dropout_keep_mask, global_linear_index
from cosmotrain.kernels.linear import (linear_backward_data, linear_backward_weight,
                                       linear_forward)
from cosmotrain.kernels.loss import mae_backward, mae_sum, mse_backward, mse_sum


def numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of a scalar function of a float64 array."""
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        up = f(x)
        x[i] = old - eps
        down = f(x)
        x[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


def test_leaky_relu_forward_backward() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 4)).astype(np.float32)
    y = leaky_relu_forward(x.copy(), 0.1)
    assert np.array_equal(y, np.where(x > 0, x, 0.1 * x))
    dy = rng.normal(size=x.shape).astype(np.float32)
    dx = leaky_relu_backward(dy.copy(), y, 0.1)
    assert np.array_equal(dx, np.where(x > 0, dy, np.float32(0.1) * dy))


def test_batchnorm_statistics_match_numpy_and_split_blocks() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 3.0, size=(2, 3, 4, 5, 6)).astype(np.float32)
    mean, var = bn_statistics(bn_local_sums(x))
    assert np.allclose(mean, x.mean(axis=(0, 2, 3, 4)), rtol=1e-6)
    assert np.allclose(var, x.var(axis=(0, 2, 3, 4)), rtol=1e-5)
    halves = bn_local_sums(x[:, :, :2]) + bn_local_sums(x[:, :, 2:])
    assert np.allclose(halves, bn_local_sums(x), rtol=1e-12)


def _bn_loss(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, r: np.ndarray) -> float:
    mean, var = bn_statistics(bn_local_sums(x))
    y, _, _ = bn_normalize(x, mean, var, gamma, beta, 1e-5)
    return float((y * r).sum())


def test_batchnorm_backward_finite_differences() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 3, 2, 2))
    gamma, beta = rng.normal(size=3), rng.normal(size=3)
    r = rng.normal(size=x.shape)
    mean, var = bn_statistics(bn_local_sums(x))
    _, xhat, inv_std = bn_normalize(x, mean, var, gamma, beta, 1e-5)
    sums = bn_backward_local_sums(r, xhat)
    dx = bn_backward_apply(r, xhat, gamma, inv_std, sums, x.size // 3)
    assert np.allclose(dx, numeric_grad(lambda v: _bn_loss(v, gamma, beta, r), x), atol=1e-6)
    dgamma = numeric_grad(lambda g: _bn_loss(x, g, beta, r), gamma.copy())
    dbeta = numeric_grad(lambda b: _bn_loss(x, gamma, b, r), beta.copy())
    assert np.allclose(sums[1], dgamma, atol=1e-6) and np.allclose(sums[0], dbeta, atol=1e-6)


def test_dropout_mask_is_partition_invariant() -> None:
    shape = (4, 3, 6, 5, 7)
    full = dropout_keep_mask(shape, (0,) * 5, shape, 0.3, seed=5, step=2, salt=9)
    block = dropout_keep_mask((2, 3, 3, 5, 4), (2, 0, 3, 0, 3), shape, 0.3, 5, 2, 9)
    assert np.array_equal(block, full[2:4, :, 3:6, :, 3:7])
    assert abs(full.mean() - 0.7) < 0.03
    again = dropout_keep_mask(shape, (0,) * 5, shape, 0.3, seed=5, step=2, salt=9)
    assert np.array_equal(again, full)
    for other in ({"seed": 6, "step": 2, "salt": 9}, {"seed": 5, "step": 3, "salt": 9},
                  {"seed": 5, "step": 2, "salt": 10}):
        assert not np.array_equal(dropout_keep_mask(shape, (0,) * 5, shape, 0.3, **other),
                                  full)


def test_global_linear_index() -> None:
    index = global_linear_index((2, 3), (1, 2), (4, 7))
    assert np.array_equal(index, np.arange(28).reshape(4, 7)[1:3, 2:5])


def test_linear_finite_differences() -> None:
    rng = np.random.default_rng(3)
    x, w, b = rng.normal(size=(3, 5)), rng.normal(size=(4, 5)), rng.normal(size=4)
    r = rng.normal(size=(3, 4))
    assert np.allclose(linear_forward(x, w, b), x @ w.T + b)
    dw, db = linear_backward_weight(x, r)
    assert np.allclose(dw, numeric_grad(lambda v: (linear_forward(x, v, b) * r).sum(), w))
    assert np.allclose(db, r.sum(axis=0))
    dx = linear_backward_data(r, w)
    assert np.allclose(dx, numeric_grad(lambda v: (linear_forward(v, w, b) * r).sum(), x))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_weight_gradient_of_one_sample_is_the_gemm_bit_for_bit(dtype) -> None:
    """One sample takes an outer product (OpenBLAS's sgemm with an inner dimension of 1 is
    3x slower): the same single products as the GEMM, so the same bits."""
    rng = np.random.default_rng(5)
    x, dy = rng.normal(size=(1, 7)).astype(dtype), rng.normal(size=(1, 3)).astype(dtype)
    dw, db = linear_backward_weight(x, dy)
    assert dw.dtype == dtype and dw.shape == (3, 7)
    np.testing.assert_array_equal(dw, dy.T @ x)
    np.testing.assert_array_equal(db, dy[0])


@pytest.mark.parametrize("kind", ["mse", "mae"])
def test_losses_use_the_global_count(kind: str) -> None:
    rng = np.random.default_rng(4)
    pred, target = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    total, backward = (mse_sum, mse_backward) if kind == "mse" else (mae_sum, mae_backward)
    expected = ((pred - target) ** 2).sum() if kind == "mse" else abs(pred - target).sum()
    assert total(pred, target) == pytest.approx(expected)
    grad = backward(pred, target, total_count=24)
    assert np.allclose(grad, numeric_grad(lambda p: total(p, target) / 24, pred.copy()))


@pytest.mark.parametrize("chunk", [50, 300, 1 << 16])  # 2-D slabs, 3-D blocks, one piece
def test_leaky_relu_backward_in_place_on_a_strided_gradient(
        chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window layer's input gradient is a view of its halo buffer's owned planes."""
    monkeypatch.setattr(activation, "CHUNK", chunk)
    rng = np.random.default_rng(4)
    y = leaky_relu_forward(rng.normal(size=(2, 3, 5, 6, 7)).astype(np.float32), 0.2)
    buffer = rng.normal(size=(2, 3, 7, 8, 7)).astype(np.float32)
    before = buffer.copy()
    view = buffer[:, :, 1:6, 2:8, :]
    expected = np.where(y > 0, view, 0.2 * view)
    dx = leaky_relu_backward(view, y, 0.2)
    assert np.shares_memory(dx, buffer)
    np.testing.assert_allclose(dx, expected, rtol=1e-6)
    np.testing.assert_allclose(buffer[:, :, 1:6, 2:8, :], expected, rtol=1e-6)
    outside = np.ones(buffer.shape, bool)
    outside[:, :, 1:6, 2:8, :] = False
    np.testing.assert_array_equal(buffer[outside], before[outside])  # margins untouched


@pytest.mark.parametrize("shape, block", [((2, 32, 16, 16, 16), 1 << 20), ((3, 5, 7, 9, 11), 50),
                                          ((2, 6, 4), 1)])
def test_channel_sums_are_numpys_bit_for_bit(monkeypatch, shape, block) -> None:
    """The worker-pool bias gradient keeps numpy's summation order (blocks of channels,
    one or several per worker)."""
    monkeypatch.setattr(channel_sums_module, "BLOCK_ELEMENTS", block)
    _parallel.set_num_workers(2)
    try:
        for dtype in (np.float32, np.float64):
            dy = np.random.default_rng(5).standard_normal(shape).astype(dtype)
            sums = channel_sums(dy)
            assert sums.dtype == dtype
            assert np.array_equal(sums, dy.sum(axis=(0,) + tuple(range(2, dy.ndim)),
                                               dtype=dtype))
    finally:
        _parallel.set_num_workers(None)
    assert np.array_equal(channel_sums(np.zeros((0, 3, 2, 2, 2), np.float32)), np.zeros(3))


def test_leaky_relu_on_the_workers_is_the_serial_result(monkeypatch) -> None:
    """Large contiguous arrays are split into one run per worker: same values."""
    monkeypatch.setattr(activation, "CHUNK", 64)
    monkeypatch.setattr(activation, "PARALLEL_MIN", 1)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 3, 9, 10, 11)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    _parallel.set_num_workers(2)
    try:
        y = leaky_relu_forward(x.copy(), 0.3)
        dx = leaky_relu_backward(dy.copy(), y, 0.3)
    finally:
        _parallel.set_num_workers(None)
    np.testing.assert_array_equal(y, np.where(x > 0, x, np.float32(0.3) * x))
    np.testing.assert_array_equal(dx, np.where(x > 0, dy, np.float32(0.3) * dy))


@pytest.mark.parametrize("slope", [0.0, 0.01, 0.3, 1.0])
def test_compiled_leaky_relu_is_the_numpy_result_bit_for_bit(monkeypatch, slope) -> None:
    """Contiguous float32 arrays take the compiled loops: the numpy passes' bits, zeros,
    signed zeros and NaN included, on one run and on the workers' runs."""
    if activation._loops() is None:
        pytest.skip("the compiled loops were not built")
    monkeypatch.setattr(activation, "PARALLEL_MIN", 1)
    rng = np.random.default_rng(7)
    x = rng.normal(size=(2, 3, 9, 10, 11)).astype(np.float32)
    x.flat[:4] = [0.0, -0.0, np.nan, -np.inf]
    dy = rng.normal(size=x.shape).astype(np.float32)
    dy.flat[4] = np.nan
    results = {}
    _parallel.set_num_workers(2)
    try:
        for compiled in (True, False):
            monkeypatch.setattr(activation, "USE_COMPILED", compiled)
            with np.errstate(invalid="ignore"):  # -inf * 0 at slope 0
                y = leaky_relu_forward(x.copy(), slope)
            results[compiled] = (y, leaky_relu_backward(dy.copy(), y, slope))
    finally:
        _parallel.set_num_workers(None)
    for ours, numpy_result in zip(results[True], results[False]):
        np.testing.assert_array_equal(ours, numpy_result)
