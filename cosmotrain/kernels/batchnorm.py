"""Batch normalisation split at its reductions.

Forward and backward each need per-channel sums over (N, D, H, W).  A distributed layer
computes the local sums with :func:`bn_local_sums` / :func:`bn_backward_local_sums`,
allreduces them over the ranks sharing a sample (and optionally the samples), and then
applies :func:`bn_normalize` / :func:`bn_backward_apply` with the global statistics.  On
one process the reduction is the identity.  Sums are accumulated in float64, so the
statistics do not depend on how the volume is partitioned beyond float32 rounding.

C-contiguous float32 and bfloat16 device arrays take our own kernels
(:mod:`.cuda.raw_bn`, ``cuda/src/batchnorm.cu``): one pass for both float64 sums (and the
count row), one for normalisation (``xhat`` written only when kept), one for the input
gradient, each reading the storage dtype as stored and computing as the CPU does (the
applies are its bits; the sums its values to float64 rounding).  Other device arrays
(strided views, float64) use the fused cupy kernels (:mod:`.cuda.fused`).  On the CPU
bfloat16 arrays are widened to float32 (the sums are float64 anyway) and the stored
results (``y``, ``xhat``, ``dx``) rounded back to bfloat16.

On a device the count stays on the device (:func:`bn_count`): reading it would make
the host wait for every kernel queued before it.
"""

from __future__ import annotations

from typing import Any


import numpy as np

from cosmotrain.device.xp import array_module, is_device_array
from cosmotrain.kernels.cuda import fused, raw_bn
from cosmotrain.kernels.route import route
from cosmotrain.precision import narrow, widen

_AXES = (0, 2, 3, 4)


def _per_channel(v: Any, ndim: int) -> Any:
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _ours(*arrays: Any) -> bool:
    """Whether device ``arrays`` suit batchnorm.cu: C-contiguous, one storage dtype of
    float32 or bfloat16."""
    dtypes = {np.dtype(a.dtype).name for a in arrays}
    return (len(dtypes) == 1 and dtypes <= {"float32", "bfloat16"}
            and all(a.flags.c_contiguous for a in arrays))


def bn_local_sums(x: Any) -> Any:
    """Per-channel [sum, sum of squares, count] of a local block, float64, shape (3, C)."""
    where = route(x)
    if where.device and _ours(x):
        return raw_bn.channel_sums(x, count=True)
    if where.bf16:
        return bn_local_sums(widen(x))
    xp = array_module(x)
    count = x.size // x.shape[1]
    sums = x.sum(axis=_AXES, dtype=xp.float64)
    if not where.device:
        squares = xp.einsum("ncdhw,ncdhw->c", x, x, dtype=xp.float64)
    else:
        squares = fused.channel_sum_squares(x)
    return xp.stack([sums, squares, xp.full_like(sums, count)])


def bn_count(sums: Any) -> Any:
    """Elements per channel behind reduced :func:`bn_local_sums`: a float on the CPU, a
    0-d float64 array on a device (no host read inside a step)."""
    return sums[2][0] if route(sums).device else float(sums[2][0])


def bn_unbiased_factor(count: Any) -> Any:
    """``count / max(count - 1, 1)``, the unbiased variance's factor, for either kind of
    :func:`bn_count`."""
    if isinstance(count, float):
        return count / max(count - 1.0, 1.0)
    return count / array_module(count).maximum(count - 1.0, 1.0)


def bn_statistics(sums: Any) -> tuple[Any, Any]:
    """Mean and biased variance from globally reduced :func:`bn_local_sums`.

    A count of 0 (statistics over a sample group left empty by a short batch, under
    ``bn_statistics: local``) gives mean and variance 0 rather than 0 / 0: such a group
    normalises no element, and NaN statistics would only raise warnings."""
    total, squares, count = sums
    count = array_module(count).maximum(count, 1.0)
    mean = total / count
    var = squares / count - mean * mean
    return mean, var.clip(min=0.0)


def bn_normalize(x: Any, mean: Any, var: Any, gamma: Any, beta: Any, eps: float,
                 keep_xhat: bool = True) -> tuple[Any, Any, Any]:
    """Return (y, xhat, inv_std): y = gamma * xhat + beta, xhat = (x - mean) * inv_std.

    ``keep_xhat`` False (evaluation: no backward) lets our device kernel skip writing
    ``xhat`` (None then); the other routes return it anyway."""
    where = route(x)
    if where.device and _ours(x):
        xp = array_module(x)
        inv_std = (1.0 / xp.sqrt(var + eps)).astype(np.float32)
        y, xhat = raw_bn.bn_forward(x, xp.asarray(mean, dtype=np.float64), inv_std,
                                    *(xp.asarray(v, dtype=np.float32) for v in (gamma, beta)),
                                    keep_xhat=keep_xhat)
        return y, xhat, inv_std
    if where.bf16:
        y, xhat, inv_std = bn_normalize(widen(x), mean, var, gamma, beta, eps)
        return narrow(y), narrow(xhat), inv_std
    xp = array_module(x)
    inv_std = (1.0 / xp.sqrt(var + eps)).astype(x.dtype)
    if where.device:
        xhat, y = fused.bn_forward(x, *(_per_channel(v.astype(x.dtype), x.ndim)
                                             for v in (mean, inv_std, gamma, beta)))
        return y, xhat, inv_std
    xhat = x - _per_channel(mean.astype(x.dtype), x.ndim)
    xhat *= _per_channel(inv_std, x.ndim)
    y = xhat * _per_channel(gamma, x.ndim)
    y += _per_channel(beta, x.ndim)
    return y, xhat, inv_std


def bn_train_forward(x: Any, sums: Any, gamma: Any, beta: Any, buffers: dict[str, Any],
                     eps: float, momentum: float, guard: bool) -> tuple[Any, Any, Any] | None:
    """A training forward from reduced :func:`bn_local_sums` in one device launch:
    :func:`bn_statistics`, the running statistics' update (``buffers``, in place; with
    ``guard`` only where the count is not 0) and :func:`bn_normalize`, the CPU's
    operations in its order.  ``(y, xhat, inv_std)``, or None where it does not apply
    (the CPU, strided or float64 arrays, more channels than the kernel holds): then
    those three steps, one by one."""
    running = (buffers["running_mean"], buffers["running_var"])
    if not (route(x).device and _ours(x) and x.shape[1] <= raw_bn.MAX_CHANNELS
            and all(is_device_array(r) and r.dtype == np.float32 and r.flags.c_contiguous
                    for r in running)):
        return None
    xp = array_module(x)
    return raw_bn.bn_train_forward(x, xp.ascontiguousarray(sums),
                                   *(xp.asarray(v, dtype=np.float32) for v in (gamma, beta)),
                                   *running, eps, momentum, guard)


def bn_backward_local_sums(dy: Any, xhat: Any) -> Any:
    """Per-channel [sum(dy), sum(dy * xhat)] of a local block, float64, shape (2, C).

    They are also dbeta and dgamma (before their reduction over the ranks)."""
    where = route(dy)
    if where.device and _ours(dy, xhat):
        return raw_bn.channel_sums(dy, xhat)
    if where.bf16:
        return bn_backward_local_sums(widen(dy), widen(xhat))
    xp = array_module(dy)
    sum_dy = dy.sum(axis=_AXES, dtype=xp.float64)
    if not where.device:
        sum_dy_xhat = xp.einsum("ncdhw,ncdhw->c", dy, xhat, dtype=xp.float64)
    else:
        sum_dy_xhat = fused.channel_sum_products(dy, xhat)
    return xp.stack([sum_dy, sum_dy_xhat])


def bn_backward_apply(dy: Any, xhat: Any, gamma: Any, inv_std: Any, sums: Any, count: Any
                      ) -> Any:
    """dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat)), global means.

    ``count`` (:func:`bn_count`) 0 (an empty group's, see :func:`bn_statistics`) divides
    by 1: no element."""
    where = route(dy)
    xp = array_module(dy)
    if where.device and _ours(dy, xhat) and dy.shape[1] <= raw_bn.MAX_CHANNELS:
        return raw_bn.bn_backward_apply(dy, xhat, xp.ascontiguousarray(sums),
                                        xp.asarray(count, dtype=np.float64),
                                        *(xp.asarray(v, dtype=np.float32) for v in (gamma,
                                                                                    inv_std)))
    count = xp.maximum(xp.asarray(count), 1.0) if where.device else max(count, 1.0)
    if where.bf16:
        return narrow(bn_backward_apply(widen(dy), widen(xhat), gamma, inv_std, sums, count))
    mean_dy = (sums[0] / count).astype(dy.dtype)
    mean_dy_xhat = (sums[1] / count).astype(dy.dtype)
    if where.device:
        return fused.bn_backward(dy, xhat, *(_per_channel(v.astype(dy.dtype), dy.ndim)
                                                  for v in (mean_dy, mean_dy_xhat,
                                                            gamma * inv_std)))
    dx = xhat * _per_channel(mean_dy_xhat, dy.ndim)
    dx += _per_channel(mean_dy, dy.ndim)
    xp.subtract(dy, dx, out=dx)
    dx *= _per_channel(gamma * inv_std, dy.ndim)
    return dx
