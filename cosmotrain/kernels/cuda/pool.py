"""3D pooling as whole-array expressions of the inputs' array module: the GPU's pooling.

The CPU kernels (:mod:`.pool3d`) are numpy-specific: a worker pool, per-thread scratch
buffers, ``np.bincount``.  These are the same operations written once for any ``xp``
(cupy on the GPU; numpy in CI, where they are tested against the CPU kernels), with the
same conventions: average pooling counts the zero padding, max pooling pads with
``-inf``, ``argmax`` is the offset ``(a*kH + b)*kW + e`` of the maximum in its window
and ties go to the first offset.

Forward: one copy of the input into a padded array, then a separable reduction (along D,
then H, then W; ``k`` strided slices per dimension instead of ``k^3``).  The argmax
compares every window tap with the maximum, taps in reverse order so the first offset
is written last; a window holding a NaN points at its first NaN.  Backward: average
pooling spreads ``dy / k^3`` back separably (each 1-D window sum's transpose: ``k``
strided adds), max pooling adds ``dy`` into each window's argmax tap (one masked strided
add per tap, which also sums overlapping windows); the padding is cropped at the end.

float32 and bf16 device arrays take our CUDA kernels instead (:mod:`.cuda.raw_ops`):
average pooling in one pass each way, in the CPU kernels' adding order (their bits);
max pooling over 2x2x2 windows that tile the input (MLPerf's) with the same maxima,
offsets and NaN rule, and no host wait for the NaN check.  ``launch`` runs them through
another launcher (the tests: the kernels' host build, on numpy arrays).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from cosmotrain.device.xp import array_module


def _along(a: Any, axis: int, start: int, count: int, step: int) -> Any:
    """``count`` elements of ``a`` along ``axis`` from ``start`` every ``step``."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, start + (count - 1) * step + 1, step)
    return a[tuple(index)]


def _padded(x: Any, padding: Any, fill: float) -> Any:
    """``x`` in an array of ``fill`` extended by ``padding`` (one (lo, hi) per D, H, W)."""
    xp = array_module(x)
    shape = x.shape[:2] + tuple(n + lo + hi for n, (lo, hi) in zip(x.shape[2:], padding))
    out = xp.full(shape, fill, dtype=x.dtype)
    out[(Ellipsis,) + tuple(slice(lo, lo + n) for n, (lo, _) in
                            zip(x.shape[2:], padding))] = x
    return out


def _cropped(padded: Any, padding: Any, spatial: Sequence[int]) -> Any:
    xp = array_module(padded)
    return xp.ascontiguousarray(padded[(Ellipsis,) + tuple(
        slice(lo, lo + n) for n, (lo, _) in zip(spatial, padding))])


def _reduce(padded: Any, pool: Any, op: Callable) -> Any:
    """``out[j] = op over e of padded[j*s + e]`` along D, H and W in turn."""
    out = padded
    for dim in range(3):
        axis, k, s, n = 2 + dim, pool.kernel[dim], pool.stride[dim], pool.out[dim]
        acc = _along(out, axis, 0, n, s).copy()
        for e in range(1, k):
            op(acc, _along(out, axis, e, n, s), out=acc)
        out = acc
    return out


def _taps(pool: Any) -> list[tuple[int, tuple[Any, ...]]]:
    """``(offset, index of the tap's inputs in the padded array)`` of every window tap."""
    taps = []
    for a, b, e in itertools.product(*(range(k) for k in pool.kernel)):
        index = tuple(slice(t, t + (n - 1) * s + 1, s)
                      for t, n, s in zip((a, b, e), pool.out, pool.stride))
        taps.append(((a * pool.kernel[1] + b) * pool.kernel[2] + e, (Ellipsis,) + index))
    return taps


def avg_pool3d_forward(x: Any, pool: Any, launch: Optional[Callable] = None) -> Any:
    """Average pooling (zero padding counted in the divisor) for the geometry ``pool``."""
    if _own_kernel(x, launch):
        from cosmotrain.kernels.cuda import raw_ops
        return raw_ops.avg_pool_forward(array_module(x).ascontiguousarray(x), pool, launch)
    y = _reduce(_padded(x, pool.padding, 0.0), pool, array_module(x).add)
    y *= y.dtype.type(1.0 / int(np.prod(pool.kernel)))
    return y


def avg_pool3d_backward(dy: Any, pool: Any, launch: Optional[Callable] = None) -> Any:
    """Gradient of :func:`avg_pool3d_forward`: the scaled spread of ``dy``."""
    xp = array_module(dy)
    if _own_kernel(dy, launch):
        from cosmotrain.kernels.cuda import raw_ops
        return raw_ops.avg_pool_backward(xp.ascontiguousarray(dy), pool, launch=launch)
    grad = dy * dy.dtype.type(1.0 / int(np.prod(pool.kernel)))
    padded = [n + lo + hi for n, (lo, hi) in zip(pool.x_shape[2:], pool.padding)]
    for dim in (2, 1, 0):
        axis, k, s, n = 2 + dim, pool.kernel[dim], pool.stride[dim], pool.out[dim]
        shape = list(grad.shape)
        shape[axis] = padded[dim]
        spread = xp.zeros(shape, dtype=dy.dtype)
        for e in range(k):
            _along(spread, axis, e, n, s)[...] += grad
        grad = spread
    return _cropped(grad, pool.padding, pool.x_shape[2:])


def _own_kernel(array: Any, launch: Optional[Callable], tiled: Any = None) -> bool:
    """Whether our CUDA kernels pool: a float32 or bf16 device array (or any such array,
    given a launcher), for max pooling over 2x2x2 windows tiling it (``tiled``: its
    geometry)."""
    if tiled is not None and not (tuple(tiled.kernel) == (2, 2, 2)
                                  and tuple(tiled.stride) == (2, 2, 2)
                                  and all(lo == 0 and hi == 0 for lo, hi in tiled.padding)):
        return False
    return (array.dtype.name in ("float32", "bfloat16")
            and (array_module(array) is not np or launch is not None))


def max_pool3d_forward(x: Any, pool: Any, launch: Optional[Callable] = None
                       ) -> tuple[Any, Any]:
    """Max pooling with ``-inf`` padding: ``(y, argmax)``."""
    xp = array_module(x)
    if _own_kernel(x, launch, tiled=pool):
        from cosmotrain.kernels.cuda import raw_ops
        return raw_ops.max_pool2_forward(xp.ascontiguousarray(x), launch=launch)
    padded = _padded(x, pool.padding, -np.inf)
    y = _reduce(padded, pool, xp.maximum)
    arg = xp.zeros(y.shape, dtype=pool.argmax_dtype)
    taps = _taps(pool)[::-1]  # the last match written is the first offset
    for offset, index in taps:
        arg[padded[index] == y] = offset
    if bool(xp.isnan(y).any()):  # NaN never equals itself: point at the window's NaN
        for offset, index in taps:
            arg[xp.isnan(padded[index])] = offset
    return y, arg


def max_pool3d_backward(dy: Any, argmax: Any, pool: Any,
                        launch: Optional[Callable] = None) -> Any:
    """Gradient of :func:`max_pool3d_forward`: ``dy`` added at each window's maximum."""
    xp = array_module(dy)
    if _own_kernel(dy, launch, tiled=pool):
        from cosmotrain.kernels.cuda import raw_ops
        return raw_ops.max_pool2_backward(xp.ascontiguousarray(dy), xp.ascontiguousarray(argmax),
                                          pool.x_shape, launch=launch)
    shape = dy.shape[:2] + tuple(n + lo + hi for n, (lo, hi) in
                                 zip(pool.x_shape[2:], pool.padding))
    grad = xp.zeros(shape, dtype=dy.dtype)
    zero = dy.dtype.type(0)
    for offset, index in _taps(pool):
        grad[index] += xp.where(argmax == offset, dy, zero)
    return _cropped(grad, pool.padding, pool.x_shape[2:])
