"""Kernels beyond float32/float64 numpy: the xp-generic pooling and bf16 storage.

* ``kernels/cuda/pool.py`` is the GPU's pooling, written for any array module; on numpy
  it must reproduce the CPU kernels (strides below and above the kernel, asymmetric
  padding, ties and NaN for max pooling).
* Every kernel accepts bfloat16 arrays (the CPU emulation of ``precision: bf16``): it
  computes in float32 and rounds what it stores, so its result must be the float32
  kernel's on the same (bf16-rounded) inputs, rounded once: within a few bf16 ulps.
"""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.kernels import activation, batchnorm, conv3d, dropout, linear, loss, pool3d
from cosmotrain.kernels.cuda import pool as pool3d_xp
from cosmotrain.nn.module import Parameter
from cosmotrain.precision import (accumulator, bfloat16, is_bf16, narrow, storage_dtype,
                                  widen)

BF16_RTOL = 2 ** -7  # two bf16 ulps (8 significant bits), relative to the result's norm

POOLS = [  # (x shape, kernel, stride, padding)
    ((2, 3, 7, 6, 5), (3, 3, 3), (2, 2, 2), ((1, 1),) * 3),
    ((1, 2, 8, 8, 8), (2, 2, 2), (2, 2, 2), 0),
    ((1, 2, 6, 7, 5), (3, 2, 3), (1, 2, 3), ((1, 0), (0, 1), (2, 1))),
    ((2, 1, 9, 5, 6), (2, 3, 2), (3, 1, 2), ((1, 1), (1, 1), (0, 1))),
]


def relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("shape, kernel, stride, padding", POOLS)
def test_xp_pooling_matches_the_cpu_kernels(shape, kernel, stride, padding) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=shape).astype(np.float32)
    pool = pool3d.PoolGeometry(shape, kernel, stride, padding)
    y = pool3d.avg_pool3d_forward(x, kernel, stride, padding)
    np.testing.assert_allclose(pool3d_xp.avg_pool3d_forward(x, pool), y, rtol=1e-6, atol=1e-6)
    dy = rng.normal(size=y.shape).astype(np.float32)
    np.testing.assert_allclose(pool3d_xp.avg_pool3d_backward(dy, pool),
                               pool3d.avg_pool3d_backward(dy, shape, kernel, stride, padding),
                               rtol=1e-6, atol=1e-6)
    x[0, 0, :2, :2, :2] = 0.5  # ties: the first offset wins, as in the CPU kernel
    x[-1, -1, 2, 1, 1] = np.nan
    maxpool = pool3d.PoolGeometry(shape, kernel, stride, padding, max_pool=True)
    y, arg = pool3d.max_pool3d_forward(x, kernel, stride, padding)
    y_xp, arg_xp = pool3d_xp.max_pool3d_forward(x, maxpool)
    np.testing.assert_array_equal(y_xp, y)
    np.testing.assert_array_equal(arg_xp, arg)
    assert arg_xp.dtype == arg.dtype
    np.testing.assert_allclose(
        pool3d_xp.max_pool3d_backward(dy, arg, maxpool),
        pool3d.max_pool3d_backward(dy, arg, shape, kernel, stride, padding), rtol=1e-6,
        atol=1e-6)


def test_precision_helpers() -> None:
    bf = bfloat16()
    x = np.array([1.0, 1 + 2 ** -9, 3.14159], np.float32)
    assert storage_dtype("bf16") == bf and storage_dtype("tf32") == np.float32
    assert is_bf16(narrow(x)) and not is_bf16(x) and widen(x) is x
    assert widen(narrow(x)).dtype == np.float32
    assert narrow(x)[1] == 1.0  # round to nearest even
    assert accumulator(bf) == np.float32 and accumulator(np.float64) == np.float64
    with pytest.raises(ValueError):
        storage_dtype("fp16")


def test_parameters_keep_float32_masters_and_gradients() -> None:
    param = Parameter(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    activations = np.zeros(3, bfloat16())
    working = param.like(activations)
    assert is_bf16(working) and param.data.dtype == np.float32
    assert param.like(np.zeros(3, np.float32)) is param.data
    param.accumulate(narrow(np.ones((2, 3), np.float32)))
    param.accumulate(narrow(np.ones((2, 3), np.float32)))
    assert param.grad.dtype == np.float32 and np.all(param.grad == 2)


def bf16_case(rng: np.random.Generator, shape) -> tuple[np.ndarray, np.ndarray]:
    """A bf16 array and the same values in float32."""
    x = narrow(rng.normal(size=shape).astype(np.float32))
    return x, widen(x)


def check_bf16(got, want) -> None:
    assert is_bf16(got), got.dtype
    assert relative(widen(got), want) <= BF16_RTOL


def test_bf16_convolutions() -> None:
    rng = np.random.default_rng(2)
    x, x32 = bf16_case(rng, (2, 3, 6, 5, 7))
    w, w32 = bf16_case(rng, (4, 3, 3, 3, 3))
    pad = ((1, 0), (1, 1), (0, 1))
    y32 = conv3d.conv3d_forward(x32, w32, 1, pad)
    check_bf16(conv3d.conv3d_forward(x, w, 1, pad), y32)
    dy, dy32 = bf16_case(rng, y32.shape)
    check_bf16(conv3d.conv3d_backward_data(dy, w, x.shape, 1, pad),
               conv3d.conv3d_backward_data(dy32, w32, x.shape, 1, pad))
    check_bf16(conv3d.conv3d_backward_filter(x, dy, w.shape, 1, pad),
               conv3d.conv3d_backward_filter(x32, dy32, w.shape, 1, pad))
    y2 = conv3d.conv3d_forward(x32, w32, 2, 1)
    dy2, dy2_32 = bf16_case(rng, y2.shape)
    check_bf16(conv3d.conv3d_backward_data(dy2, w, x.shape, 2, 1),
               conv3d.conv3d_backward_data(dy2_32, w32, x.shape, 2, 1))
    with pytest.raises(ValueError, match="out="):
        conv3d.conv3d_forward(x, w, 1, pad, out=np.empty(y32.shape, np.float32))


def test_bf16_pooling() -> None:
    rng = np.random.default_rng(3)
    x, x32 = bf16_case(rng, (2, 3, 7, 6, 5))
    y32 = pool3d.avg_pool3d_forward(x32, 3, 2, 1)
    check_bf16(pool3d.avg_pool3d_forward(x, 3, 2, 1), y32)
    dy, dy32 = bf16_case(rng, y32.shape)
    check_bf16(pool3d.avg_pool3d_backward(dy, x.shape, 3, 2, 1),
               pool3d.avg_pool3d_backward(dy32, x.shape, 3, 2, 1))
    y, arg = pool3d.max_pool3d_forward(x, 2, 2, 0)
    y32, arg32 = pool3d.max_pool3d_forward(x32, 2, 2, 0)
    check_bf16(y, y32)
    np.testing.assert_array_equal(arg, arg32)
    dy, dy32 = bf16_case(rng, y32.shape)
    check_bf16(pool3d.max_pool3d_backward(dy, arg, x.shape, 2, 2, 0),
               pool3d.max_pool3d_backward(dy32, arg32, x.shape, 2, 2, 0))


def test_bf16_elementwise_and_batchnorm() -> None:
    rng = np.random.default_rng(4)
    x, x32 = bf16_case(rng, (2, 3, 4, 5, 6))
    check_bf16(activation.leaky_relu_forward(x.copy(), 0.1),
               activation.leaky_relu_forward(x32.copy(), 0.1))
    dy, dy32 = bf16_case(rng, x.shape)
    check_bf16(activation.leaky_relu_backward(dy.copy(), x, 0.1),
               activation.leaky_relu_backward(dy32.copy(), x32, 0.1))
    sums = batchnorm.bn_local_sums(x)
    assert sums.dtype == np.float64
    np.testing.assert_allclose(sums, batchnorm.bn_local_sums(x32), rtol=1e-12)
    mean, var = batchnorm.bn_statistics(sums)
    gamma, beta = rng.normal(size=3).astype(np.float32), rng.normal(size=3).astype(np.float32)
    y, xhat, inv_std = batchnorm.bn_normalize(x, mean, var, gamma, beta, 1e-5)
    y32, xhat32, inv32 = batchnorm.bn_normalize(x32, mean, var, gamma, beta, 1e-5)
    check_bf16(y, y32)
    check_bf16(xhat, xhat32)
    np.testing.assert_array_equal(inv_std, inv32)
    back = batchnorm.bn_backward_local_sums(dy, xhat)
    np.testing.assert_allclose(back, batchnorm.bn_backward_local_sums(dy32, widen(xhat)),
                               rtol=1e-12)
    check_bf16(batchnorm.bn_backward_apply(dy, xhat, gamma, inv_std, back, 40.0),
               batchnorm.bn_backward_apply(dy32, widen(xhat), gamma, inv_std, back, 40.0))
    keep = dropout.dropout_keep_mask(x.shape, (0,) * 5, x.shape, 0.3, 1, 2, 3)
    check_bf16(dropout.dropout_forward(x, keep, 0.3), dropout.dropout_forward(x32, keep, 0.3))


def test_bf16_linear_and_loss() -> None:
    rng = np.random.default_rng(5)
    x, x32 = bf16_case(rng, (3, 8))
    w, w32 = bf16_case(rng, (4, 8))
    b, b32 = bf16_case(rng, (4,))
    check_bf16(linear.linear_forward(x, w, b), linear.linear_forward(x32, w32, b32))
    dy, dy32 = bf16_case(rng, (3, 4))
    check_bf16(linear.linear_backward_data(dy, w), linear.linear_backward_data(dy32, w32))
    dw, db = linear.linear_backward_weight(x, dy)
    dw32, db32 = linear.linear_backward_weight(x32, dy32)
    assert dw.dtype == db.dtype == np.float32  # parameter gradients stay float32
    np.testing.assert_allclose(dw, dw32, rtol=1e-6)
    target = rng.normal(size=(3, 4)).astype(np.float32)
    assert loss.mse_sum(dy, target) == pytest.approx(loss.mse_sum(dy32, target), rel=1e-12)
    assert loss.mae_sum(dy, target) == pytest.approx(loss.mae_sum(dy32, target), rel=1e-12)
    check_bf16(loss.mse_backward(dy, target, 12), loss.mse_backward(dy32, target, 12))
    check_bf16(loss.mae_backward(dy, target, 12), loss.mae_backward(dy32, target, 12))
