"""3D average and max pooling, forward and backward: the front door.

Conventions: NCDHW arrays, ``kernel`` and ``stride`` triples (or ints; ``stride=None``
means ``kernel``), asymmetric padding ``((lo, hi),) * 3`` (:mod:`.pool_geometry`); a
batch of no sample (``N = 0``) gives empty results on any device.

* average: zero padding *counted* in the divisor, which is always ``kD*kH*kW``
  (PyTorch ``count_include_pad=True``, the CosmoFlow k3 s2 p1 pooling);
* max: padding is ``-inf``; NaN propagates.  ``argmax`` is the offset of the maximum
  inside its window, ``(a*kH + b)*kW + e``, as int8 (int16 for windows over 127
  elements); ties go to the first offset in that order, as in PyTorch.

Each call is routed once (:func:`.route.route`): cupy arrays to :mod:`.cuda.pool`;
bfloat16 storage pooled in float32 and rounded back (:mod:`cosmotrain.precision`);
float numpy arrays to the compiled average pooling (:mod:`.compiled.avgpool`, float32),
the 2x2x2 tiling max pooling (:mod:`.cpu.maxpool_tiled`) or the separable numpy
reductions (:mod:`.cpu.pooling`), which all give the same bits.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.compiled import avgpool as avgpool_compiled
from cosmotrain.kernels.cpu import maxpool_tiled, pooling
from cosmotrain.kernels.cuda import pool as cuda_pool
from cosmotrain.kernels.geometry import PaddingLike
from cosmotrain.kernels.pool_geometry import PoolGeometry, check_pooled_grad, pools_by_planes
from cosmotrain.kernels.route import route
from cosmotrain.precision import narrow, widen

__all__ = ["PoolGeometry", "avg_pool3d_backward", "avg_pool3d_forward", "check_pooled_grad",
           "max_pool3d_backward", "max_pool3d_forward", "pools_by_planes"]


def avg_pool3d_forward(x: np.ndarray, kernel, stride=None, padding: PaddingLike = 0, *,
                       by_planes: bool = False) -> np.ndarray:
    """Average pooling, zero padding counted: divisor ``kD*kH*kW`` everywhere.

    ``by_planes``: reduce one output plane at a time whatever the volume, for a caller
    pooling a slab of planes of a larger input (:func:`pools_by_planes`)."""
    pool = PoolGeometry(x.shape, kernel, stride, padding, by_planes=by_planes)
    if pool.empty:
        return array_module(x).zeros(pool.y_shape, dtype=x.dtype)
    where = route(x)
    if where.device:
        return cuda_pool.avg_pool3d_forward(x, pool)
    if where.bf16:
        return narrow(avg_pool3d_forward(widen(x), kernel, stride, padding, by_planes=by_planes))
    x = np.ascontiguousarray(x)
    if avgpool_compiled.applies(x):
        return avgpool_compiled.forward(x, pool)
    return pooling.avg_forward(x, pool)


def avg_pool3d_backward(dy: np.ndarray, x_shape: Sequence[int], kernel, stride=None,
                        padding: PaddingLike = 0) -> np.ndarray:
    """Gradient of :func:`avg_pool3d_forward` with respect to its input."""
    pool = PoolGeometry(x_shape, kernel, stride, padding)
    check_pooled_grad(dy, pool)
    if pool.empty:
        return array_module(dy).zeros(pool.x_shape, dtype=dy.dtype)
    where = route(dy)
    if where.device:
        return cuda_pool.avg_pool3d_backward(dy, pool)
    if where.bf16:
        return narrow(avg_pool3d_backward(widen(dy), x_shape, kernel, stride, padding))
    dy = np.ascontiguousarray(dy)
    if avgpool_compiled.applies(dy):
        return avgpool_compiled.backward(dy, pool)
    return pooling.avg_backward(dy, pool)


def max_pool3d_forward(x: np.ndarray, kernel, stride=None, padding: PaddingLike = 0, *,
                       by_planes: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Max pooling with ``-inf`` padding; returns ``(y, argmax)`` (see module doc).

    ``by_planes`` as for :func:`avg_pool3d_forward` (maxima and argmax are exact either
    way; it keeps a slab on the large volume's path)."""
    pool = PoolGeometry(x.shape, kernel, stride, padding, max_pool=True, by_planes=by_planes)
    if pool.empty:
        xp = array_module(x)
        return (xp.zeros(pool.y_shape, dtype=x.dtype),
                xp.zeros(pool.y_shape, dtype=pool.argmax_dtype))
    where = route(x)
    if where.device:
        return cuda_pool.max_pool3d_forward(x, pool)
    if where.bf16:
        y, arg = max_pool3d_forward(widen(x), kernel, stride, padding, by_planes=by_planes)
        return narrow(y), arg
    x = np.ascontiguousarray(x)
    if maxpool_tiled.applies(pool.kernel, pool.stride, pool.padding):
        y = np.empty(pool.y_shape, dtype=x.dtype)
        arg = np.zeros(pool.y_shape, dtype=pool.argmax_dtype)
        maxpool_tiled.forward(x, y, arg)
        return y, arg
    return pooling.max_forward(x, pool)


def max_pool3d_backward(dy: np.ndarray, argmax: np.ndarray, x_shape: Sequence[int], kernel,
                        stride=None, padding: PaddingLike = 0) -> np.ndarray:
    """Gradient of :func:`max_pool3d_forward`: ``dy`` routed to each window's maximum."""
    pool = PoolGeometry(x_shape, kernel, stride, padding, max_pool=True)
    check_pooled_grad(dy, pool)
    if argmax.shape != dy.shape:
        raise ValueError(f"argmax shape {argmax.shape} does not match dy shape {dy.shape}")
    if pool.empty:
        return array_module(dy).zeros(pool.x_shape, dtype=dy.dtype)
    where = route(dy)
    if where.device:
        return cuda_pool.max_pool3d_backward(dy, argmax, pool)
    if where.bf16:
        return narrow(max_pool3d_backward(widen(dy), argmax, x_shape, kernel, stride, padding))
    dy = np.ascontiguousarray(dy)
    if maxpool_tiled.applies(pool.kernel, pool.stride, pool.padding):
        dx = np.empty(pool.x_shape, dtype=dy.dtype)
        maxpool_tiled.backward(dy, np.ascontiguousarray(argmax), dx)
        return dx
    return pooling.max_backward(dy, argmax, pool)
