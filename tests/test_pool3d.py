"""Pooling against direct loops (forward) and exact adjoints / finite differences."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest

from cosmotrain.kernels.pool3d import (avg_pool3d_backward, avg_pool3d_forward,
                                       max_pool3d_backward, max_pool3d_forward)

CASES = [  # kernel, stride, padding ((lo, hi) per dim), spatial shape
    ((3, 3, 3), (2, 2, 2), ((1, 1),) * 3, (7, 6, 5)),
    ((2, 2, 2), (2, 2, 2), ((0, 0),) * 3, (6, 5, 4)),
    ((3, 2, 1), (1, 2, 1), ((1, 0), (0, 1), (0, 0)), (5, 6, 3)),
    ((3, 3, 3), (2, 1, 3), ((2, 1), (1, 2), (0, 1)), (4, 5, 7)),
]


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


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES)
def test_avg_pool_forward_and_adjoint(kernel, stride, padding, shape) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3) + shape)
    y = avg_pool3d_forward(x, kernel, stride, padding)
    assert np.allclose(y, reference(x, kernel, stride, padding, "avg"))
    r = rng.normal(size=y.shape)
    dx = avg_pool3d_backward(r, x.shape, kernel, stride, padding)
    assert dx.shape == x.shape
    assert (y * r).sum() == pytest.approx((x * dx).sum(), rel=1e-12)  # linear: exact adjoint


@pytest.mark.parametrize("kernel, stride, padding, shape", CASES)
def test_max_pool_forward_and_gradient(kernel, stride, padding, shape) -> None:
    rng = np.random.default_rng(1)
    x = rng.permutation(np.prod((2, 3) + shape)).reshape((2, 3) + shape) * 0.01  # no ties
    y, argmax = max_pool3d_forward(x, kernel, stride, padding)
    assert np.array_equal(y, reference(x, kernel, stride, padding, "max"))
    r = rng.normal(size=y.shape)
    dx = max_pool3d_backward(r, argmax, x.shape, kernel, stride, padding)
    eps = 1e-4  # piecewise linear: central differences are exact away from ties
    for index in list(np.ndindex(x.shape))[::7]:
        bumped = [x.copy(), x.copy()]
        bumped[0][index] += eps
        bumped[1][index] -= eps
        up, down = (float((reference(b, kernel, stride, padding, "max") * r).sum())
                    for b in bumped)
        assert dx[index] == pytest.approx((up - down) / (2 * eps), abs=1e-8)


def test_float32_stays_float32() -> None:
    x = np.ones((1, 2, 4, 4, 4), dtype=np.float32)
    assert avg_pool3d_forward(x, 3, 2, 1).dtype == np.float32
    assert max_pool3d_forward(x, 2, 2, 0)[0].dtype == np.float32
