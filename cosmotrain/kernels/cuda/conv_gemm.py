"""3D convolution by im2col + one GEMM per chunk: the fallback that needs only cupy.

Written against the array module of its inputs (:func:`cosmotrain.device.xp.array_module`),
so the same code runs on cupy (cuBLAS GEMMs) and on numpy, where CI tests it against
:mod:`cosmotrain.kernels.conv3d`.  Conventions are the CPU kernels': NCDHW arrays, weights
``(F, C, kD, kH, kW)`` (cross-correlation), stride a triple or int, padding one
``(lo, hi)`` pair per spatial dimension (:mod:`cosmotrain.kernels.geometry`).

Algorithm.  Output planes are cut into chunks (:func:`gemm_chunks`): whole samples when
their column matrix fits ``budget`` bytes, else runs of depth planes of one sample.  A
chunk copies the padded input region it reads into a zero-filled slab (one copy, cast to
the compute dtype), views the slab as the column matrix ``(C*kD*kH*kW, n*planes*Ho*Wo)``
with ``as_strided`` (cupy has it too) and materialises it with one copy; then

* forward:  ``y = W @ cols`` (W as an ``(F, C*k^3)`` matrix);
* wgrad:    ``dW += dy_chunk @ cols^T``, summed over chunks in fp32;
* dgrad:    unit stride with padding < kernel: dx is the forward convolution of dy,
  padded by ``k-1-lo`` / ``k-1-hi``, with the flipped kernel and C, F swapped (a gather,
  no scatter); otherwise ``cols = W^T @ dy_chunk`` scattered into a zero-padded fp32 dx
  with one strided add per kernel offset (col2im).

Precision.  Storage dtypes: float32, bfloat16 (``ml_dtypes.bfloat16``) and float64 (for
tests).  Every product and sum runs in the compute dtype, float32 (float64 for float64
storage): bf16 operands are widened when the slab / weight matrix are built and results
are rounded to bf16 once, at the end.  ``tf32`` (an explicit ``tf32=``, else the call's
``settings.math``): float32 GEMMs on TF32 tensor cores (cupy only, see
:func:`cosmotrain.kernels.cuda.settings.cublas_math`).  With bf16 storage TF32 is always
used: a bf16 value has 8 significant bits and TF32 keeps 11, so TF32 products of bf16
operands are exact and the result equals the fp32 GEMM's up to summation order.
The weight gradient is returned in the storage dtype (bf16 with bf16 storage), as
PyTorch's autocast does; the optimizer's fp32 master weights take it from there.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.geometry import ConvGeometry, PaddingLike, plan_chunks

from cosmotrain.kernels.cuda.settings import ConvSettings, cublas_math, resolve_settings

Chunk = Tuple[int, int, int, int]  # samples n0:n1, output depth planes z0:z1
STORAGE_DTYPES = ("float32", "bfloat16", "float64")


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (checked by name: ml_dtypes is optional)."""
    return np.dtype(dtype).name == "bfloat16"


def storage_dtype(a: Any, name: str) -> np.dtype:
    """The dtype of ``a`` if it is a supported storage dtype, else ``ValueError``."""
    dtype = np.dtype(a.dtype)
    if dtype.name not in STORAGE_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float64, got dtype {dtype.name}")
    return dtype


def compute_dtype(storage: np.dtype) -> np.dtype:
    """Accumulation dtype: float64 for float64 storage, float32 otherwise (bf16 included)."""
    return np.dtype(np.float64) if np.dtype(storage) == np.float64 else np.dtype(np.float32)


def gemm_chunks(geo: ConvGeometry, itemsize: int, budget: int) -> List[Chunk]:
    """Chunks whose column matrix and GEMM output take at most about ``budget`` bytes.

    Whole samples are grouped while they fit (fewer, larger GEMMs keep the GPU busy);
    otherwise each sample's output planes are cut into even runs, at least one plane.
    """
    per_plane = (geo.rows + geo.filters) * geo.plane * itemsize
    planes = max(1, budget // per_plane)
    depth = geo.out[0]
    if planes < depth:
        return [(n, n + 1, z0, z1) for n, z0, z1 in plan_chunks(geo.batch, depth, planes)]
    samples = max(1, min(geo.batch, planes // depth))
    return [(n0, min(geo.batch, n0 + samples), 0, depth) for n0 in range(0, geo.batch, samples)]


def padded_slab(xp: Any, x: Any, geo: ConvGeometry, chunk: Chunk, dtype: np.dtype) -> Any:
    """Zero-padded input ``(n, C, depth, Hs, Ws)`` read by the chunk, in ``dtype``.

    ``slab[:, :, i, j, k] = x[n0:n1, :, z0*sD - lo_D + i, j - lo_H, k - lo_W]`` inside
    ``x``, 0 outside: the padding (asymmetric or not) is materialised here, once.
    """
    n0, n1, z0, z1 = chunk
    _, depth, hs, ws = geo.slab_shape(z1 - z0)
    slab = xp.zeros((n1 - n0, geo.channels, depth, hs, ws), dtype=dtype)
    origin = (z0 * geo.stride[0] - geo.padding[0][0], -geo.padding[1][0], -geo.padding[2][0])
    dst, src = [], []
    for o, m, n in zip(origin, (depth, hs, ws), geo.spatial):
        lo = min(max(-o, 0), m)
        hi = max(min(n - o, m), lo)
        dst.append(slice(lo, hi))
        src.append(slice(o + lo, o + hi))
    slab[(slice(None), slice(None), *dst)] = x[(slice(n0, n1), slice(None), *src)]
    return slab


def columns(xp: Any, slab: Any, geo: ConvGeometry) -> Any:
    """Column matrix ``(C*kD*kH*kW, n*planes*Ho*Wo)`` of a slab, rows ordered (c, a, b, e).

    A strided window view of the slab copied once into a contiguous buffer.
    """
    n, c, depth = slab.shape[:3]
    planes = (depth - geo.kernel[0]) // geo.stride[0] + 1
    s_n, s_c, s_d, s_h, s_w = slab.strides
    st_d, st_h, st_w = geo.stride
    shape = (c,) + geo.kernel + (n, planes) + geo.out[1:]
    strides = (s_c, s_d, s_h, s_w, s_n, s_d * st_d, s_h * st_h, s_w * st_w)
    view = xp.lib.stride_tricks.as_strided(slab, shape, strides)
    return xp.ascontiguousarray(view).reshape(geo.rows, -1)


def weight_matrix(xp: Any, w: Any, storage: np.dtype, compute: np.dtype) -> Any:
    """``(F, C*kD*kH*kW)`` weights, rounded to the storage dtype, then widened."""
    w = w.astype(storage, copy=False).astype(compute, copy=False)
    return xp.ascontiguousarray(w).reshape(w.shape[0], -1)


def gradient_matrix(xp: Any, dy: Any, chunk: Chunk, compute: np.dtype) -> Any:
    """``(F, n*planes*Ho*Wo)`` matrix of the chunk's output gradient, columns in the
    order of :func:`columns`."""
    n0, n1, z0, z1 = chunk
    block = dy[n0:n1, :, z0:z1].transpose(1, 0, 2, 3, 4)
    return xp.ascontiguousarray(block, dtype=compute).reshape(dy.shape[1], -1)


def _resolve(settings: Optional[ConvSettings], budget: Optional[int], tf32: Optional[bool]
             ) -> Tuple[int, bool]:
    """The GEMM budget and TF32 switch: explicit values, else those of ``settings``."""
    settings = resolve_settings(settings)
    return (settings.gemm_budget_bytes if budget is None else int(budget),
            settings.math == "tf32" if tf32 is None else bool(tf32))


def _forward_into(xp: Any, x: Any, wmat: Any, geo: ConvGeometry, y: Any,
                  compute: np.dtype, budget: int) -> Any:
    """``y = conv(x)`` chunk by chunk (``wmat`` from :func:`weight_matrix`)."""
    for chunk in gemm_chunks(geo, compute.itemsize, budget):
        n0, n1, z0, z1 = chunk
        cols = columns(xp, padded_slab(xp, x, geo, chunk, compute), geo)
        out = xp.matmul(wmat, cols).reshape((geo.filters, n1 - n0, z1 - z0) + geo.out[1:])
        y[n0:n1, :, z0:z1] = out.transpose(1, 0, 2, 3, 4)
    return y


def conv3d_forward(x: Any, w: Any, stride: "int | Sequence[int]" = 1,
                   padding: PaddingLike = 0, *, budget: Optional[int] = None,
                   tf32: Optional[bool] = None, settings: Optional[ConvSettings] = None) -> Any:
    """``y = conv3d(x, w)``: x (N,C,D,H,W), w (F,C,kD,kH,kW) -> y (N,F,Do,Ho,Wo), dtype of x.

    ``budget`` / ``tf32`` default to those of ``settings`` (``gemm_budget_bytes``,
    ``math == "tf32"``; None: the defaults of :class:`~.settings.ConvSettings`).
    """
    xp = array_module(x, w)
    storage = storage_dtype(x, "x")
    geo = ConvGeometry.create(x.shape, w.shape, stride, padding)
    budget, tf32 = _resolve(settings, budget, tf32)
    compute = compute_dtype(storage)
    y = xp.empty(geo.y_shape, dtype=storage)
    with cublas_math(xp, tf32 or is_bfloat16(storage)):
        return _forward_into(xp, x, weight_matrix(xp, w, storage, compute), geo, y, compute,
                             budget)


def conv3d_backward_filter(x: Any, dy: Any, w_shape: Sequence[int],
                           stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                           budget: Optional[int] = None, tf32: Optional[bool] = None,
                           settings: Optional[ConvSettings] = None) -> Any:
    """``dL/dw`` of shape ``w_shape`` in the storage dtype of x, summed in fp32 (or fp64)."""
    xp = array_module(x, dy)
    storage = storage_dtype(x, "x")
    geo = ConvGeometry.create(x.shape, w_shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    budget, tf32 = _resolve(settings, budget, tf32)
    compute = compute_dtype(storage)
    dy = dy.astype(storage, copy=False)
    total = xp.zeros((geo.filters, geo.rows), dtype=compute)
    with cublas_math(xp, tf32 or is_bfloat16(storage)):
        for chunk in gemm_chunks(geo, compute.itemsize, budget):
            cols = columns(xp, padded_slab(xp, x, geo, chunk, compute), geo)
            total += xp.matmul(gradient_matrix(xp, dy, chunk, compute), cols.T)
    return xp.ascontiguousarray(total.reshape(geo.w_shape), dtype=storage)


def conv3d_backward_data(dy: Any, w: Any, x_shape: Sequence[int],
                         stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                         budget: Optional[int] = None, tf32: Optional[bool] = None,
                         settings: Optional[ConvSettings] = None) -> Any:
    """``dL/dx`` of shape ``x_shape`` in the storage dtype of dy."""
    xp = array_module(dy, w)
    storage = storage_dtype(dy, "dy")
    geo = ConvGeometry.create(x_shape, w.shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    budget, tf32 = _resolve(settings, budget, tf32)
    compute = compute_dtype(storage)
    fits = all(lo < k and hi < k for (lo, hi), k in zip(geo.padding, geo.kernel))
    with cublas_math(xp, tf32 or is_bfloat16(storage)):
        if geo.stride != (1, 1, 1) or not fits:
            return _backward_data_scatter(xp, dy, w, geo, storage, compute, budget)
        flipped = w[:, :, ::-1, ::-1, ::-1].transpose(1, 0, 2, 3, 4)
        pad_t = tuple((k - 1 - lo, k - 1 - hi) for (lo, hi), k in zip(geo.padding, geo.kernel))
        tgeo = ConvGeometry.create(dy.shape, flipped.shape, 1, pad_t)
        dx = xp.empty(geo.x_shape, dtype=storage)
        return _forward_into(xp, dy, weight_matrix(xp, flipped, storage, compute), tgeo, dx,
                             compute, budget)


def _backward_data_scatter(xp: Any, dy: Any, w: Any, geo: ConvGeometry, storage: np.dtype,
                           compute: np.dtype, budget: int) -> Any:
    """dx for any stride and padding: ``W^T @ dy`` per chunk, added back by col2im.

    One strided add per kernel offset into a zero-padded accumulator in the compute
    dtype (the offsets' target views overlap, so they cannot be fused into one add).
    """
    wt = weight_matrix(xp, w, storage, compute).T
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(geo.spatial, geo.padding))
    acc = xp.zeros((geo.batch, geo.channels) + padded, dtype=compute)
    (sd, sh, sw), (_, ho, wo) = geo.stride, geo.out
    for chunk in gemm_chunks(geo, compute.itemsize, budget):
        n0, n1, z0, z1 = chunk
        planes = z1 - z0
        cols = xp.matmul(wt, gradient_matrix(xp, dy, chunk, compute))
        cols = cols.reshape((geo.channels,) + geo.kernel + (n1 - n0, planes, ho, wo))
        for a, b, e in itertools.product(*map(range, geo.kernel)):
            za = z0 * sd + a
            dst = acc[n0:n1, :, za:za + (planes - 1) * sd + 1:sd, b:b + (ho - 1) * sh + 1:sh,
                      e:e + (wo - 1) * sw + 1:sw]
            dst += cols[:, a, b, e].transpose(1, 0, 2, 3, 4)
    (dl, _), (hl, _), (wl, _) = geo.padding
    d, h, w_ = geo.spatial
    return xp.ascontiguousarray(acc[:, :, dl:dl + d, hl:hl + h, wl:wl + w_], dtype=storage)
