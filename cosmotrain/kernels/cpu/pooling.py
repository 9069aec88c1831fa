"""3D average and max pooling in numpy (float32 / float64), forward and backward.

* average: zero padding *counted* in the divisor, which is always ``kD*kH*kW``
  (PyTorch ``count_include_pad=True``, the CosmoFlow k3 s2 p1 pooling);
* max: padding is ``-inf``; NaN propagates.  ``argmax`` is the offset of the maximum
  inside its window, ``(a*kH + b)*kW + e``, as int8 (int16 for windows over 127
  elements); ties go to the first offset in that order, as in PyTorch.

Algorithm: separable window reductions (sum or maximum along D, then H, then W: 3k strided
slice operations instead of k^3), on chunks that own whole channels of one sample, so
chunks never conflict and run on the kernel worker pool (numpy releases the GIL).  Small
volumes are reduced whole; large ones one output depth plane at a time, so that the
intermediate arrays stay in L2 (each output plane then sums its taps in the same order
whatever part of the input a call covers: :func:`~cosmotrain.kernels.pool_geometry.
pools_by_planes`).  Backward: average pooling runs the transposed operations; max pooling
sends each gradient to its input index with ``np.bincount`` (which also sums the
overlaps of windows with stride < kernel).  The front door :mod:`cosmotrain.kernels.pool3d`
sends 2x2x2 tiling max pooling to :mod:`.maxpool_tiled` and float32 average pooling to the
compiled loops (:mod:`cosmotrain.kernels.compiled.avgpool`), which keep these orders.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels import pool_geometry
from cosmotrain.kernels.pool_geometry import PoolGeometry


def _along(a: np.ndarray, axis: int, start: int, stop: Optional[int], step: int = 1) -> np.ndarray:
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop, step)
    return a[tuple(index)]


def _accumulate(dst: np.ndarray, parts, ufunc: Callable = np.add, empty: float = 0.0) -> None:
    """``dst = empty; view = ufunc(view, src)`` for ``(view of dst, src)`` parts, cheaply.

    Parts covering all of ``dst`` are combined straight into it (the first two in one
    ufunc call); ``dst`` is filled with ``empty`` only when no part covers it.
    """
    full = [src for view, src in parts if view.shape == dst.shape]
    rest = [(view, src) for view, src in parts if view.shape != dst.shape]
    if len(full) >= 2:
        ufunc(full[0], full[1], out=dst)
    elif full:
        np.copyto(dst, full[0])
    else:
        dst.fill(empty)
    for src in full[2:]:
        ufunc(dst, src, out=dst)
    for view, src in rest:
        ufunc(view, src, out=view)


def _window(pool: PoolGeometry, dim: int, axis: int, a: np.ndarray, out: np.ndarray,
            ufunc: Callable = np.add, empty: float = 0.0) -> None:
    """``out[j] = ufunc-reduce_e a[j*s + e - lo]`` along ``axis`` (pooling dim ``dim``)."""
    s, parts = pool.stride[dim], []
    for e in range(pool.kernel[dim]):
        j0, j1, i0 = pool.taps(dim, e)
        if j1 > j0:
            parts.append((_along(out, axis, j0, j1),
                          _along(a, axis, i0, i0 + (j1 - j0 - 1) * s + 1, s)))
    _accumulate(out, parts, ufunc, empty)


def _spread(pool: PoolGeometry, dim: int, axis: int, g: np.ndarray, out: np.ndarray) -> None:
    """Transpose of the window sum, one residue class of ``out`` (mod stride) at a time.

    Input ``i = r + m*s`` receives ``g[m + q]`` from every tap ``e`` with ``r + lo - e = q*s``.
    """
    (s, (lo, _), k), n_out = (pool.stride[dim], pool.padding[dim], pool.kernel[dim]), g.shape[axis]
    for r in range(min(s, out.shape[axis])):
        dst = _along(out, axis, r, None, s)
        parts, count = [], dst.shape[axis]
        for e in range(k):
            q, rem = divmod(r + lo - e, s)
            m0, m1 = max(0, -q), min(count, n_out - q)
            if rem == 0 and m1 > m0:
                parts.append((_along(dst, axis, m0, m1), _along(g, axis, m0 + q, m1 + q)))
        _accumulate(dst, parts)


def _reduce(x: np.ndarray, pool: PoolGeometry, ufunc: Callable, empty: float,
            finish: Callable) -> np.ndarray:
    """Separable window reduction of every chunk; ``finish(chunk, yb)`` post-processes it."""
    y = np.empty(pool.y_shape, dtype=x.dtype)
    (h, w), (do, ho, _), whole = pool.x_shape[3:], pool.out, pool.whole(x.itemsize)

    def work(chunk):
        n, c0, c1 = chunk
        xb, yb, cb = x[n, c0:c1], y[n, c0:c1], c1 - c0
        if whole:
            depth = workers.scratch("pool_d", (cb, do, h, w), x.dtype)
            rows = workers.scratch("pool_h", (cb, do, ho, w), x.dtype)
            _window(pool, 0, 1, xb, depth, ufunc, empty)
            _window(pool, 1, 2, depth, rows, ufunc, empty)
            _window(pool, 2, 3, rows, yb, ufunc, empty)
        else:
            depth = workers.scratch("pool_d", (cb, h, w), x.dtype)
            rows = workers.scratch("pool_h", (cb, ho, w), x.dtype)
            for z in range(do):
                _accumulate(depth, [(depth, xb[:, p]) for _, p in pool.planes_of(z)], ufunc, empty)
                _window(pool, 1, 1, depth, rows, ufunc, empty)
                _window(pool, 2, 2, rows, yb[:, z], ufunc, empty)
        finish(chunk, yb)

    workers.map_chunks(work, pool.chunks(x.itemsize))
    return y


def avg_forward(x: np.ndarray, pool: PoolGeometry) -> np.ndarray:
    """Average pooling of a C-contiguous float array, zero padding counted."""
    scale = 1.0 / int(np.prod(pool.kernel))
    return _reduce(x, pool, np.add, 0.0, lambda chunk, yb: np.multiply(yb, scale, out=yb))


def avg_backward(dy: np.ndarray, pool: PoolGeometry) -> np.ndarray:
    """Gradient of :func:`avg_forward`: a gather over output planes, then spreads along
    H and W."""
    dx = np.empty(pool.x_shape, dtype=dy.dtype)
    (d, h, _), (_, ho, wo), whole = pool.x_shape[2:], pool.out, pool.whole(dy.itemsize)
    scale = 1.0 / int(np.prod(pool.kernel))
    sources: List[List[int]] = [[] for _ in range(d)]  # output planes reading each input plane
    for z in range(pool.out[0]):
        for _, p in pool.planes_of(z):
            sources[p].append(z)

    def work(chunk):
        n, c0, c1 = chunk
        gb, dxb, cb = dy[n, c0:c1], dx[n, c0:c1], c1 - c0
        if whole:
            g = workers.scratch("pool_g", gb.shape, dy.dtype)
            depth = workers.scratch("pool_d", (cb, d, ho, wo), dy.dtype)
            rows = workers.scratch("pool_h", (cb, d, h, wo), dy.dtype)
            np.multiply(gb, scale, out=g)
            _spread(pool, 0, 1, g, depth)
            _spread(pool, 1, 2, depth, rows)
            _spread(pool, 2, 3, rows, dxb)
            return
        depth = workers.scratch("pool_d", (cb, ho, wo), dy.dtype)
        rows = workers.scratch("pool_h", (cb, h, wo), dy.dtype)
        for p in range(d):
            _accumulate(depth, [(depth, gb[:, z]) for z in sources[p]])
            np.multiply(depth, scale, out=depth)
            _spread(pool, 1, 1, depth, rows)
            _spread(pool, 2, 2, rows, dxb[:, p])

    workers.map_chunks(work, pool.chunks(dy.itemsize))
    return dx


def max_forward(x: np.ndarray, pool: PoolGeometry) -> Tuple[np.ndarray, np.ndarray]:
    """``(y, argmax)`` of max pooling with ``-inf`` padding: separable maxima, then each
    tap compared with the maximum (the last match in reverse order is the first offset)."""
    arg = np.zeros(pool.y_shape, dtype=pool.argmax_dtype)
    whole = pool.whole(x.itemsize)

    def find_argmax(chunk, yb) -> None:
        n, c0, c1 = chunk
        xb, ab = x[n, c0:c1], arg[n, c0:c1]
        for z in [None] if whole else range(pool.out[0]):
            yz, az = (yb, ab) if z is None else (yb[:, z:z + 1], ab[:, z:z + 1])
            taps = list(pool.offsets(z))[::-1]  # the last match written is the first offset
            for offset, out, inp in taps:
                np.copyto(az[out], offset, where=xb[inp] == yz[out])
            if np.isnan(yz).any():  # NaN never equals itself: point at a NaN of the window
                for offset, out, inp in taps:
                    np.copyto(az[out], offset, where=np.isnan(xb[inp]))

    return _reduce(x, pool, np.maximum, -np.inf, find_argmax), arg


def max_backward(dy: np.ndarray, argmax: np.ndarray, pool: PoolGeometry) -> np.ndarray:
    """Gradient of :func:`max_forward`: ``dy`` routed to each window's maximum.

    Each output's flat input index is ``base(position) + delta[argmax]``; ``np.bincount``
    with ``dy`` as weights then sums the gradients per input element (overlapping
    windows included) in one pass, over slabs of output planes of about ``BLOCK_BYTES``.
    """
    dx = np.zeros(pool.x_shape, dtype=dy.dtype)
    (d, h, w), (kd, kh, kw) = pool.x_shape[2:], pool.kernel
    delta = ((np.arange(kd)[:, None, None] * h + np.arange(kh)[:, None]) * w
             + np.arange(kw)).ravel()  # flat input offset of each window offset
    starts = [np.arange(n) * s - lo for n, s, (lo, _) in zip(pool.out, pool.stride, pool.padding)]

    def work(chunk):  # chunks own whole channels and run their slabs in order
        n, c0, c1 = chunk
        planes = max(1, pool_geometry.BLOCK_BYTES // ((c1 - c0) * pool.stride[0] * h * w * 8))
        for z0 in range(0, pool.out[0], planes):
            z1 = min(pool.out[0], z0 + planes)
            p0 = max(0, z0 * pool.stride[0] - pool.padding[0][0])
            p1 = min(d, (z1 - 1) * pool.stride[0] - pool.padding[0][0] + kd)
            flat = delta[argmax[n, c0:c1, z0:z1]]
            flat += ((starts[0][z0:z1, None, None] - p0) * h + starts[1][:, None]) * w + starts[2]
            flat += (np.arange(c1 - c0) * ((p1 - p0) * h * w))[:, None, None, None]
            sums = np.bincount(flat.ravel(), weights=dy[n, c0:c1, z0:z1].ravel(),
                               minlength=(c1 - c0) * (p1 - p0) * h * w)
            view = dx[n, c0:c1, p0:p1]
            np.add(view, sums.reshape(view.shape), out=view, casting="same_kind")

    workers.map_chunks(work, pool.chunks(dy.itemsize))
    return dx
