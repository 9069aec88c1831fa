"""3D average and max pooling for the CPU (numpy), forward and backward.

Conventions as for the convolutions: NCDHW arrays, ``kernel`` and ``stride`` triples (or
ints; ``stride=None`` means ``kernel``), asymmetric padding ``((lo, hi),) * 3``; a batch of
no sample (``N = 0``) gives empty results on any device.

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
whatever part of the input a call covers: :func:`pools_by_planes`).  The max-pool argmax
is found afterwards by comparing each tap with the maximum (last match in reverse order
= first offset).  Backward: average pooling runs the transposed operations (a gather
over output planes, then spreads along H and W); max pooling sends each gradient to its
input index with ``np.bincount`` (which also sums the overlaps of windows with stride <
kernel).  Max pooling over 2x2x2 windows that tile the input (MLPerf's) takes
:mod:`.maxpool_tiled`, float32 average pooling :mod:`.avgpool_compiled` (compiled loops).

Other devices and storage: cupy arrays take the whole-array implementation of
:mod:`.pool3d_xp` (same geometry, conventions and results); bfloat16 arrays are pooled
in float32 and the values rounded back to bfloat16 (:mod:`cosmotrain.precision`).
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from cosmotrain.device.xp import array_module, is_device_array
from cosmotrain.precision import is_bf16, narrow, widen

from cosmotrain.kernels.cpu import workers as _parallel, maxpool_tiled
from cosmotrain.kernels.compiled import avgpool as avgpool_compiled
from cosmotrain.kernels.cuda import pool as pool3d_xp
from cosmotrain.kernels.geometry import (Padding, PaddingLike, Triple, check_batch_shape, normalize_padding,
                       normalize_triple, output_shape)

# Chunks (channels of one sample) are reduced whole up to WHOLE_BYTES of input, else one
# output plane at a time on blocks of about BLOCK_BYTES a plane.
WHOLE_BYTES = 1 << 20
BLOCK_BYTES = 512 << 10
MIN_CHUNK_BYTES = 1 << 20


def pools_by_planes(x_shape: Sequence[int], like) -> bool:
    """Whether the CPU kernels pool an input of ``x_shape`` with the device and dtype of
    the array ``like`` one output plane at a time (a channel's volume over
    ``WHOLE_BYTES``; bfloat16 is pooled in float32).

    Why a caller asks: plane by plane, every output plane sums its taps in the same
    order whichever of the input's planes a call gets, so the input may be pooled in
    slabs of planes (``by_planes=True``) with exactly the results of one call, and no
    whole copy of it need exist (the spatial layer's extended block, ``layers/pool.py``;
    whole volumes sum along D in an order set by the taps reaching the padding; the
    compiled loops keep these orders).  False for device arrays (:mod:`.pool3d_xp`)."""
    if is_device_array(like):
        return False
    itemsize = 4 if is_bf16(like) else like.dtype.itemsize
    return int(np.prod(tuple(x_shape)[2:])) * itemsize > WHOLE_BYTES


class PoolGeometry:
    """Validated pooling geometry; ``by_planes`` reduces one output plane at a time
    whatever the volume (see :func:`pools_by_planes`)."""

    def __init__(self, x_shape: Sequence[int], kernel, stride, padding,
                 max_pool: bool = False, by_planes: bool = False) -> None:
        x_shape = tuple(int(v) for v in x_shape)
        check_batch_shape(x_shape)
        self.x_shape = x_shape
        self.by_planes = by_planes
        self.kernel: Triple = normalize_triple(kernel, "kernel")
        self.stride: Triple = normalize_triple(self.kernel if stride is None else stride, "stride")
        self.padding: Padding = normalize_padding(padding)
        if max_pool and any(max(pad) >= k for pad, k in zip(self.padding, self.kernel)):
            raise ValueError(f"max pooling padding {self.padding} must be smaller than the "
                             f"kernel {self.kernel} (a window of padding only has no maximum)")
        self.out: Triple = output_shape(x_shape[2:], self.kernel, self.stride, self.padding)
        self.y_shape = x_shape[:2] + self.out

    @property
    def argmax_dtype(self) -> np.dtype:
        """int8 offsets, int16 for windows over 127 elements."""
        return np.dtype(np.int8 if np.prod(self.kernel) <= 127 else np.int16)

    @property
    def empty(self) -> bool:
        """No sample (a sample group left empty by a short batch): nothing to compute, on
        any device; the results are empty arrays."""
        return self.x_shape[0] == 0

    def taps(self, dim: int, e: int) -> Tuple[int, int, int]:
        """Outputs ``j0:j1`` whose tap ``e`` reads a real input; ``i0`` = input of ``j0``.

        Input index of output ``j``'s tap ``e`` is ``j*s + e - lo``.
        """
        s, (lo, _), n_in, n_out = (self.stride[dim], self.padding[dim], self.x_shape[2 + dim],
                                   self.out[dim])
        j0 = max(0, -((e - lo) // s))
        j1 = min(n_out, (n_in - 1 - e + lo) // s + 1)
        return j0, max(j0, j1), j0 * s + e - lo

    def whole(self, itemsize: int) -> bool:
        """Reduce chunks whole (small volumes) rather than plane by plane."""
        return not self.by_planes and int(np.prod(self.x_shape[2:])) * itemsize <= WHOLE_BYTES

    def chunks(self, itemsize: int) -> List[Tuple[int, int, int]]:
        """(sample, first channel, end channel) blocks of whole channels.

        At most ``WHOLE_BYTES`` (whole) or ``BLOCK_BYTES`` per plane; small enough to give
        every worker two blocks, unless that makes blocks of under ``MIN_CHUNK_BYTES``
        (thread hand-offs would cost more than they save).
        """
        n, c = self.x_shape[:2]
        whole = self.whole(itemsize)
        size = int(np.prod(self.x_shape[2 if whole else 3:])) * itemsize
        volume = int(np.prod(self.x_shape[2:])) * itemsize
        balanced = max(-(-c // -(-2 * _parallel.num_workers() // n)), -(-MIN_CHUNK_BYTES // volume))
        block = max(1, min(c, balanced, (WHOLE_BYTES if whole else BLOCK_BYTES) // size))
        return [(i, c0, min(c, c0 + block)) for i in range(n) for c0 in range(0, c, block)]

    def planes_of(self, z: int) -> List[Tuple[int, int]]:
        """(tap a, input plane) pairs of output plane ``z`` that lie inside the input."""
        taps = ((a, z * self.stride[0] + a - self.padding[0][0]) for a in range(self.kernel[0]))
        return [(a, p) for a, p in taps if 0 <= p < self.x_shape[2]]

    def offsets(self, z: Optional[int] = None) -> Iterator[Tuple[int, tuple, tuple]]:
        """``(offset, output index, input index)`` of every window tap on a channel block.

        Whole blocks (``z is None``) index ``(cb, D, H, W)`` / ``(cb, Do, Ho, Wo)`` arrays;
        for output plane ``z`` the output index is into ``[:, z:z+1]`` and the input
        index selects the tap's input plane.
        """
        (kd, kh, kw), s = self.kernel, self.stride
        depth = ([(a, self.taps(0, a)) for a in range(kd)] if z is None else
                 [(a, (0, 1, p)) for a, p in self.planes_of(z)])
        for a, td in depth:
            for b, e in np.ndindex(kh, kw):
                spans = (td, self.taps(1, b), self.taps(2, e))
                if all(j1 > j0 for j0, j1, _ in spans):
                    out = tuple(slice(j0, j1) for j0, j1, _ in spans)
                    inp = tuple(slice(i0, i0 + (j1 - j0 - 1) * st + 1, st)
                                for (j0, j1, i0), st in zip(spans, s))
                    yield (a * kh + b) * kw + e, (slice(None),) + out, (slice(None),) + inp


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
            depth = _parallel.scratch("pool_d", (cb, do, h, w), x.dtype)
            rows = _parallel.scratch("pool_h", (cb, do, ho, w), x.dtype)
            _window(pool, 0, 1, xb, depth, ufunc, empty)
            _window(pool, 1, 2, depth, rows, ufunc, empty)
            _window(pool, 2, 3, rows, yb, ufunc, empty)
        else:
            depth = _parallel.scratch("pool_d", (cb, h, w), x.dtype)
            rows = _parallel.scratch("pool_h", (cb, ho, w), x.dtype)
            for z in range(do):
                _accumulate(depth, [(depth, xb[:, p]) for _, p in pool.planes_of(z)], ufunc, empty)
                _window(pool, 1, 1, depth, rows, ufunc, empty)
                _window(pool, 2, 2, rows, yb[:, z], ufunc, empty)
        finish(chunk, yb)

    _parallel.map_chunks(work, pool.chunks(x.itemsize))
    return y


def check_pooled_grad(dy: np.ndarray, pool: PoolGeometry) -> None:
    if dy.shape != pool.y_shape:
        raise ValueError(f"dy shape {dy.shape} does not match the pooling of x {pool.x_shape} "
                         f"(kernel {pool.kernel}, stride {pool.stride}, padding {pool.padding}): "
                         f"expected {pool.y_shape}")


def _elsewhere(array) -> bool:
    """Whether the call leaves the numpy float code: a device array or bf16 storage."""
    return is_device_array(array) or is_bf16(array)


def avg_pool3d_forward(x: np.ndarray, kernel, stride=None, padding: PaddingLike = 0, *,
                       by_planes: bool = False) -> np.ndarray:
    """Average pooling, zero padding counted: divisor ``kD*kH*kW`` everywhere.

    ``by_planes``: reduce one output plane at a time whatever the volume, for a caller
    pooling a slab of planes of a larger input (:func:`pools_by_planes`)."""
    pool = PoolGeometry(x.shape, kernel, stride, padding, by_planes=by_planes)
    if pool.empty:
        return array_module(x).zeros(pool.y_shape, dtype=x.dtype)
    if _elsewhere(x):
        if is_bf16(x):
            return narrow(avg_pool3d_forward(widen(x), kernel, stride, padding,
                                             by_planes=by_planes))
        return pool3d_xp.avg_pool3d_forward(x, pool)
    x = np.ascontiguousarray(x)
    if avgpool_compiled.applies(x):
        return avgpool_compiled.forward(x, pool)
    scale = 1.0 / int(np.prod(pool.kernel))
    return _reduce(x, pool, np.add, 0.0, lambda chunk, yb: np.multiply(yb, scale, out=yb))


def avg_pool3d_backward(dy: np.ndarray, x_shape: Sequence[int], kernel, stride=None,
                        padding: PaddingLike = 0) -> np.ndarray:
    """Gradient of :func:`avg_pool3d_forward` with respect to its input."""
    pool = PoolGeometry(x_shape, kernel, stride, padding)
    check_pooled_grad(dy, pool)
    if pool.empty:
        return array_module(dy).zeros(pool.x_shape, dtype=dy.dtype)
    if _elsewhere(dy):
        if is_bf16(dy):
            return narrow(avg_pool3d_backward(widen(dy), x_shape, kernel, stride, padding))
        return pool3d_xp.avg_pool3d_backward(dy, pool)
    dy = np.ascontiguousarray(dy)
    if avgpool_compiled.applies(dy):
        return avgpool_compiled.backward(dy, pool)
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
            g = _parallel.scratch("pool_g", gb.shape, dy.dtype)
            depth = _parallel.scratch("pool_d", (cb, d, ho, wo), dy.dtype)
            rows = _parallel.scratch("pool_h", (cb, d, h, wo), dy.dtype)
            np.multiply(gb, scale, out=g)
            _spread(pool, 0, 1, g, depth)
            _spread(pool, 1, 2, depth, rows)
            _spread(pool, 2, 3, rows, dxb)
            return
        depth = _parallel.scratch("pool_d", (cb, ho, wo), dy.dtype)
        rows = _parallel.scratch("pool_h", (cb, h, wo), dy.dtype)
        for p in range(d):
            _accumulate(depth, [(depth, gb[:, z]) for z in sources[p]])
            np.multiply(depth, scale, out=depth)
            _spread(pool, 1, 1, depth, rows)
            _spread(pool, 2, 2, rows, dxb[:, p])

    _parallel.map_chunks(work, pool.chunks(dy.itemsize))
    return dx


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
    if _elsewhere(x):
        if is_bf16(x):
            y, arg = max_pool3d_forward(widen(x), kernel, stride, padding, by_planes=by_planes)
            return narrow(y), arg
        return pool3d_xp.max_pool3d_forward(x, pool)
    x = np.ascontiguousarray(x)
    arg = np.zeros(pool.y_shape, dtype=pool.argmax_dtype)
    if maxpool_tiled.applies(pool.kernel, pool.stride, pool.padding):
        y = np.empty(pool.y_shape, dtype=x.dtype)
        maxpool_tiled.forward(x, y, arg)
        return y, arg
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


def max_pool3d_backward(dy: np.ndarray, argmax: np.ndarray, x_shape: Sequence[int], kernel,
                        stride=None, padding: PaddingLike = 0) -> np.ndarray:
    """Gradient of :func:`max_pool3d_forward`: ``dy`` routed to each window's maximum.

    Each output's flat input index is ``base(position) + delta[argmax]``; ``np.bincount``
    with ``dy`` as weights then sums the gradients per input element (overlapping
    windows included) in one pass, over slabs of output planes of about ``BLOCK_BYTES``.
    """
    pool = PoolGeometry(x_shape, kernel, stride, padding, max_pool=True)
    check_pooled_grad(dy, pool)
    if argmax.shape != dy.shape:
        raise ValueError(f"argmax shape {argmax.shape} does not match dy shape {dy.shape}")
    if pool.empty:
        return array_module(dy).zeros(pool.x_shape, dtype=dy.dtype)
    if _elsewhere(dy):
        if is_bf16(dy):
            return narrow(max_pool3d_backward(widen(dy), argmax, x_shape, kernel, stride,
                                              padding))
        return pool3d_xp.max_pool3d_backward(dy, argmax, pool)
    dy = np.ascontiguousarray(dy)
    if maxpool_tiled.applies(pool.kernel, pool.stride, pool.padding):
        dx = np.empty(pool.x_shape, dtype=dy.dtype)
        maxpool_tiled.backward(dy, np.ascontiguousarray(argmax), dx)
        return dx
    dx = np.zeros(pool.x_shape, dtype=dy.dtype)
    (d, h, w), (kd, kh, kw) = pool.x_shape[2:], pool.kernel
    delta = ((np.arange(kd)[:, None, None] * h + np.arange(kh)[:, None]) * w
             + np.arange(kw)).ravel()  # flat input offset of each window offset
    starts = [np.arange(n) * s - lo for n, s, (lo, _) in zip(pool.out, pool.stride, pool.padding)]

    def work(chunk):  # chunks own whole channels and run their slabs in order
        n, c0, c1 = chunk
        planes = max(1, BLOCK_BYTES // ((c1 - c0) * pool.stride[0] * h * w * 8))
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

    _parallel.map_chunks(work, pool.chunks(dy.itemsize))
    return dx
