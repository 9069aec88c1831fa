"""Fused cupy kernels for the GPU's element-wise and per-channel work.

Where the xp-generic expression of a kernel makes several passes over an activation
(LeakyReLU's backward: a comparison, a product and a select, each a full read and
write; batch norm: a subtraction, two products and a sum), one ``ElementwiseKernel``
reads each input once and writes each output once, and a ``ReductionKernel`` squares
and sums in float64 without a float64 copy of the activation.  Element-wise kernels
accept any strides (the halo buffer's owned planes) and broadcast per-channel operands
shaped ``(1, C, 1, 1, 1)``.  Built on first use (cupy compiles them then, once per
dtype); float32 and float64 only: bf16 storage is widened before these run.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

AXES = (0, 2, 3, 4)


@functools.cache
def kernels() -> SimpleNamespace:
    """The compiled kernels (cupy imported here, never at module import)."""
    import cupy  # type: ignore[import-not-found]

    return SimpleNamespace(
        leaky_forward=cupy.ElementwiseKernel(
            "T x, T slope", "T y", "y = x > 0 ? x : x * slope",
            "cosmotrain_leaky_relu_forward"),
        leaky_backward=cupy.ElementwiseKernel(
            "T dy, T y, T slope", "T dx", "dx = y > 0 ? dy : dy * slope",
            "cosmotrain_leaky_relu_backward"),
        sum_squares=cupy.ReductionKernel(
            "T x", "float64 total", "(double)x * (double)x", "a + b", "total = a", "0",
            "cosmotrain_sum_squares"),
        sum_products=cupy.ReductionKernel(
            "T x, T y", "float64 total", "(double)x * (double)y", "a + b", "total = a", "0",
            "cosmotrain_sum_products"),
        bn_forward=cupy.ElementwiseKernel(
            "T x, T mean, T inv_std, T gamma, T beta", "T xhat, T y",
            "xhat = (x - mean) * inv_std; y = xhat * gamma + beta",
            "cosmotrain_bn_forward"),
        bn_backward=cupy.ElementwiseKernel(
            "T dy, T xhat, T mean_dy, T mean_dy_xhat, T scale", "T dx",
            "dx = (dy - (xhat * mean_dy_xhat + mean_dy)) * scale",
            "cosmotrain_bn_backward"),
    )


def leaky_relu_forward(x: Any, slope: float, out: Any) -> Any:
    """``out = x > 0 ? x : slope * x`` (``out`` may be ``x``: in place)."""
    return kernels().leaky_forward(x, x.dtype.type(slope), out)


def leaky_relu_backward(dy: Any, y: Any, slope: float, out: Any) -> Any:
    """``out = y > 0 ? dy : slope * dy`` (``out`` may be ``dy``, strided or not)."""
    return kernels().leaky_backward(dy, y, dy.dtype.type(slope), out)


def channel_sum_squares(x: Any) -> Any:
    """Per-channel sum of ``x * x`` over (N, D, H, W), accumulated in float64."""
    return kernels().sum_squares(x, axis=AXES)


def channel_sum_products(x: Any, y: Any) -> Any:
    """Per-channel sum of ``x * y`` over (N, D, H, W), accumulated in float64."""
    return kernels().sum_products(x, y, axis=AXES)


def bn_forward(x: Any, mean: Any, inv_std: Any, gamma: Any, beta: Any) -> tuple[Any, Any]:
    """``(xhat, y)``: ``xhat = (x - mean) * inv_std``, ``y = gamma * xhat + beta``; the
    per-channel operands already shaped ``(1, C, 1, 1, 1)`` in ``x``'s dtype."""
    return kernels().bn_forward(x, mean, inv_std, gamma, beta)


def bn_backward(dy: Any, xhat: Any, mean_dy: Any, mean_dy_xhat: Any, scale: Any) -> Any:
    """``dx = (dy - mean_dy - xhat * mean_dy_xhat) * scale`` (per-channel operands as in
    :func:`bn_forward`)."""
    return kernels().bn_backward(dy, xhat, mean_dy, mean_dy_xhat, scale)
