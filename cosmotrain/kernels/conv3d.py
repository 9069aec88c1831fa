"""3D convolution kernels for the CPU (numpy + BLAS): forward, data gradient, filter gradient.

Conventions: NCDHW float arrays (float32 in training; float64 accepted, the tests use
it), weights ``(F, C, kD, kH, kW)`` as in PyTorch (cross-correlation), stride a triple,
padding one ``(lo, hi)`` pair per spatial dimension of zeros (asymmetric: a block that
already carries halos is called with 0 on those sides, see :mod:`.geometry`).  Output
``Do = (D + lo + hi - kD) // sD + 1``.  Input and output stay NCDHW.

Algorithm: chunked GEMM lowering.  Each sample's output is cut into runs of whole depth
planes (chunks, about ``CHUNK_BYTES`` of buffers); per chunk the zero-padded input slab
and the column matrix are built in per-thread scratch buffers, one GEMM (``np.matmul``
with ``out=``) computes the chunk, and for split lowerings (:mod:`.lowering`) ``kW`` (or
``kH*kW``) shifted adds finish it straight into the output.  Chunks run on a pool of
workers with one single-threaded BLAS each (:mod:`._parallel`).  Results do not depend
on the scheduling (chunks own disjoint outputs; filter-gradient partials are summed in
chunk order).

* forward:  y = W @ cols, split over W when the stride in W is 1.
* wgrad:    dW = dy_shifted @ cols^T, same lowering as forward.
* dgrad:    unit stride: dx is the convolution of dy padded by ``k-1-lo`` / ``k-1-hi``
  with the flipped, transposed kernel, lowered with H and W split (a gather: no zero
  fill, no read-modify-write of dx).  Other strides: ``cols = W^T @ dy`` and col2im
  (:mod:`.conv3d_dgrad`).

Layout decision (issue: "NCDHW or channels-last: choose by measurement").  Measured with
``benchmarks/bench_conv_layout.py`` (forward, W=128 CosmoFlow layers, 2-core Zen5, OpenBLAS
0.3.31 which selects its Haswell/AVX2 kernels here), same chunking and threads:

    layer           NCDHW    channels-last    (OPENBLAS_CORETYPE=SkylakeX: NCDHW / CL)
    conv1 4->16     78 ms    116 ms  (1.48x)  75 / 97 ms
    conv2 16->32    51 ms     56 ms  (1.11x)  46 / 39 ms
    conv3 32->64    20 ms     20 ms  (1.01x)  16 / 13 ms

Channels-last copies runs of ``kW*C`` floats (12 for conv1) instead of ``Wo`` floats and
needs transposes in and out, which loses on the thin, memory-bound layers that hold 78% of
the FLOPs; only with AVX-512 GEMM kernels does its GEMM shape win on conv2/conv3.  So the
kernels stay NCDHW internally.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import _parallel
from .conv3d_dgrad import backward_data_scatter
from .geometry import PaddingLike
from .im2col import ConvGeometry, plan_chunks, planes_view
from .lowering import Lowering

# Budget for one chunk's buffers (bytes); timings are flat from 0.5 to 8 MiB here.
CHUNK_BYTES = 4 << 20
# A split lowering extends the GEMM grid by k-1; allowed while that is <= 1/16 of it.
MAX_SPLIT_WASTE = 1 / 16


def as_float_array(a: np.ndarray, name: str, dtype=None) -> np.ndarray:
    """C-contiguous floating array (no copy when it already is one)."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        raise ValueError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def output_buffer(out: Optional[np.ndarray], shape, dtype, name: str = "out") -> np.ndarray:
    """``out`` checked for shape, dtype and contiguity, or a new uninitialised array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype).name} array of shape "
                         f"{tuple(shape)}, got {out.dtype.name} {out.shape}")
    return out


def choose_lowering(geo: ConvGeometry, max_shift: int) -> Lowering:
    """Split as many trailing dims (<= max_shift) as have unit stride and little waste."""
    for shift in range(max_shift, 0, -1):
        dims = range(3 - shift, 3)
        if all(geo.stride[d] == 1 and 1 < geo.kernel[d] <= 1 + geo.out[d] * MAX_SPLIT_WASTE
               for d in dims):
            return Lowering(geo, shift)
    return Lowering(geo, 0)


def _chunks(low: Lowering, itemsize: int, extra_rows: int = 0):
    """Chunks of output planes whose buffers fit ``CHUNK_BYTES``.

    Depth-major (shift 2) chunks hold a slab of ``planes + kD - 1`` input planes and
    compute one plane at a time, so only the slab grows with the chunk.
    """
    geo = low.geo
    if low.shift == 2:
        per_plane = geo.channels * low.columns_per_plane * itemsize
        budget = CHUNK_BYTES - low.outputs * low.columns_per_plane * itemsize
        return plan_chunks(geo.batch, geo.out[0], per_plane, max(budget, per_plane))
    per_plane = (low.rows + extra_rows) * low.columns_per_plane * itemsize
    return plan_chunks(geo.batch, geo.out[0], per_plane, CHUNK_BYTES)


def _run_lowered(src: np.ndarray, wmat: np.ndarray, low: Lowering, y: np.ndarray) -> np.ndarray:
    """``y = conv(src)`` for the lowering ``low`` and its weight matrix ``wmat``."""
    kd, plane = low.geo.kernel[0], low.columns_per_plane

    def work(chunk):
        n, z0, z1 = chunk
        if low.shift == 2:
            slab = low.depth_major_slab(src[n], z0, z1).reshape(-1, plane)
            t = _parallel.scratch("gemm_out", (low.outputs, plane), src.dtype)
            for i in range(z1 - z0):
                np.matmul(wmat, slab[i * low.geo.channels:(i + kd) * low.geo.channels], out=t)
                low.sum_shifts(t, y[n, :, z0 + i:z0 + i + 1])
            return
        cols = low.columns(src[n], z0, z1)
        if low.shift == 0:
            np.matmul(wmat, cols, out=planes_view(y[n], z0, z1))
            return
        t = _parallel.scratch("gemm_out", (low.outputs, cols.shape[1]), src.dtype)
        np.matmul(wmat, cols, out=t)
        low.sum_shifts(t, y[n, :, z0:z1])

    extra = 0 if low.shift == 0 else low.outputs
    _parallel.map_chunks(work, _chunks(low, src.itemsize, extra_rows=extra))
    return y


def conv3d_forward(x: np.ndarray, w: np.ndarray, stride: "int | Sequence[int]" = 1,
                   padding: PaddingLike = 0, *, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``y = conv3d(x, w)``: x (N,C,D,H,W), w (F,C,kD,kH,kW) -> y (N,F,Do,Ho,Wo).

    ``out``: optional C-contiguous result buffer (reusing one saves the page faults of a
    fresh allocation, about 5 ms per 128 MiB here).
    """
    x = as_float_array(x, "x")
    w = as_float_array(w, "w", x.dtype)
    geo = ConvGeometry.create(x.shape, w.shape, stride, padding)
    low = choose_lowering(geo, max_shift=1)
    return _run_lowered(x, low.weights(w), low, output_buffer(out, geo.y_shape, x.dtype))


def conv3d_backward_filter(x: np.ndarray, dy: np.ndarray, w_shape: Sequence[int],
                           stride: "int | Sequence[int]" = 1,
                           padding: PaddingLike = 0) -> np.ndarray:
    """``dL/dw`` from the input x and the output gradient dy; shape ``w_shape``."""
    x = as_float_array(x, "x")
    dy = as_float_array(dy, "dy", x.dtype)
    geo = ConvGeometry.create(x.shape, w_shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    low = choose_lowering(geo, max_shift=1)

    def work(chunk):
        n, z0, z1 = chunk
        cols = low.columns(x[n], z0, z1)
        if low.shift == 0:
            return np.matmul(planes_view(dy[n], z0, z1), cols.T)
        return np.matmul(low.spread_shifts(dy[n, :, z0:z1]), cols.T)

    extra = 0 if low.shift == 0 else low.outputs
    partials = _parallel.map_chunks(work, _chunks(low, x.itemsize, extra_rows=extra))
    g = partials[0]
    for part in partials[1:]:
        g += part
    return np.ascontiguousarray(low.weights_from_matrix(g))


def conv3d_backward_data(dy: np.ndarray, w: np.ndarray, x_shape: Sequence[int],
                         stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0,
                         *, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``dL/dx`` from the output gradient dy and the weights; shape ``x_shape``."""
    dy = as_float_array(dy, "dy")
    w = as_float_array(w, "w", dy.dtype)
    geo = ConvGeometry.create(x_shape, w.shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    dx = output_buffer(out, geo.x_shape, dy.dtype)
    fits = all(lo < k and hi < k for (lo, hi), k in zip(geo.padding, geo.kernel))
    if geo.stride != (1, 1, 1) or not fits:
        return backward_data_scatter(dy, w, geo, CHUNK_BYTES, dx)
    # dx = conv(dy padded by k-1-lo / k-1-hi, flipped kernel with C and F swapped).
    flipped = w[:, :, ::-1, ::-1, ::-1].transpose(1, 0, 2, 3, 4)
    pad_t = tuple((k - 1 - lo, k - 1 - hi) for (lo, hi), k in zip(geo.padding, geo.kernel))
    tgeo = ConvGeometry.create(dy.shape, flipped.shape, 1, pad_t)
    low = choose_lowering(tgeo, max_shift=2)
    return _run_lowered(dy, low.weights(flipped), low, dx)
