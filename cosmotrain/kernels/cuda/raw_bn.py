"""Python faces of batch norm's CUDA kernels (``src/batchnorm.cu``), as
:mod:`.raw_ops`'s faces are: each allocates what it returns, sizes the launch and
passes the arguments in the kernel's types; ``launch`` is :func:`.raw.cupy_launch`
unless a caller hands another (the tests' host build of the same source).  Nothing is
read back from the device.

Arrays are C-contiguous N, C, ... blocks in float32 or bfloat16 storage; the
per-channel operands are float32 (``mean`` float64: the statistics' dtype, rounded to
float32 in the kernel as the CPU rounds it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cuda import raw
from cosmotrain.kernels.cuda.raw_ops import Launch

# Blocks the per-channel sums aim for (about 8 per SM on 132 SMs) and the fewest
# elements each thread adds before a block's tree reduction and atomics are worth it.
TARGET_BLOCKS = 1024
MIN_PER_THREAD = 32


def _launch(launch: Launch | None) -> Launch:
    return launch or raw.cupy_launch  # looked up at each call: the stand-in swaps it


def _split(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(samples, channels, voxels per channel)`` of an N, C, ... shape."""
    return int(shape[0]), int(shape[1]), math.prod(int(v) for v in shape[2:])


def slices_for(samples: int, channels: int, spatial: int, block: int = raw.BLOCK) -> int:
    """Blocks per channel of :func:`channel_sums`: enough blocks to fill the device, but
    each thread with at least ``MIN_PER_THREAD`` elements and a voxel to start on."""
    by_device = -(-TARGET_BLOCKS // max(channels, 1))
    by_work = -(-samples * spatial // (block * MIN_PER_THREAD))
    return max(1, min(by_device, by_work, -(-spatial // block)))


def channel_sums(a: Any, b: Any = None, count: bool = False,
                 launch: Launch | None = None) -> Any:
    """Per channel, float64 ``[sum(a), sum(a * b)]`` (``b`` None: ``sum(a * a)``), and
    with ``count`` a third row, the elements per channel: shape (2 or 3, C)."""
    xp = array_module(a)
    samples, channels, spatial = _split(a.shape)
    out = xp.zeros((3 if count else 2, channels), dtype=np.float64)
    if b is not None and (b.shape != a.shape or b.dtype != a.dtype):
        raise ValueError(f"channel_sums: b is {b.dtype}{b.shape}, a {a.dtype}{a.shape}")
    slices = slices_for(samples, channels, spatial)
    _launch(launch)(f"channel_sums_{raw.suffix(a.dtype)}", channels * slices * raw.BLOCK,
                    (a, b, out, samples, channels, spatial, slices, int(count)))
    return out


def bn_forward(x: Any, mean: Any, inv_std: Any, gamma: Any, beta: Any,
               keep_xhat: bool = True, launch: Launch | None = None) -> tuple[Any, Any]:
    """``(y, xhat)``: ``xhat = (x - mean) * inv_std``, ``y = xhat * gamma + beta`` per
    channel, in ``x``'s storage dtype; ``xhat`` None unless ``keep_xhat``."""
    xp = array_module(x)
    y = xp.empty_like(x)
    xhat = xp.empty_like(x) if keep_xhat else None
    _launch(launch)(f"bn_forward_{raw.suffix(x.dtype)}", x.size,
                    (x, y, xhat, mean, inv_std, gamma, beta, *_split(x.shape)))
    return y, xhat


MAX_CHANNELS = 1024  # batchnorm.cu's BN_MAX_CHANNELS: bn_train_forward's shared tables


def bn_train_forward(x: Any, sums: Any, gamma: Any, beta: Any, running_mean: Any,
                     running_var: Any, eps: float, momentum: float, guard: bool,
                     launch: Launch | None = None) -> tuple[Any, Any, Any]:
    """``(y, xhat, inv_std)`` of a training forward from the reduced ``sums`` (float64,
    (3, C)), in one launch that also updates the float32 running statistics in place
    (only where the count is not 0 with ``guard``); C at most ``MAX_CHANNELS``."""
    xp = array_module(x)
    samples, channels, spatial = _split(x.shape)
    if channels > MAX_CHANNELS:
        raise ValueError(f"bn_train_forward takes up to {MAX_CHANNELS} channels, not {channels}")
    y, xhat = xp.empty_like(x), xp.empty_like(x)
    inv_std = xp.empty(channels, dtype=np.float32)
    _launch(launch)(f"bn_train_forward_{raw.suffix(x.dtype)}", x.size,
                    (x, y, xhat, sums, gamma, beta, running_mean, running_var, inv_std,
                     float(eps), float(momentum), float(np.float32(1 - momentum)), int(guard),
                     samples, channels, spatial))
    return y, xhat, inv_std


def bn_backward_apply(dy: Any, xhat: Any, sums: Any, count: Any, gamma: Any, inv_std: Any,
                      launch: Launch | None = None) -> Any:
    """``dx = (dy - (xhat * mean_dy_xhat + mean_dy)) * scale`` per channel, in ``dy``'s
    storage dtype, the factors from the reduced backward ``sums`` (float64, (2, C)) and
    ``count`` (a float64 device scalar, raised to 1): ``mean_dy = sums[0] / count``,
    ``mean_dy_xhat = sums[1] / count`` (rounded to float32), ``scale = gamma * inv_std``;
    C at most ``MAX_CHANNELS``."""
    samples, channels, spatial = _split(dy.shape)
    if channels > MAX_CHANNELS:
        raise ValueError(f"bn_backward_apply takes up to {MAX_CHANNELS} channels, not {channels}")
    dx = array_module(dy).empty_like(dy)
    _launch(launch)(f"bn_backward_apply_{raw.suffix(dy.dtype)}", dy.size,
                    (dy, xhat, dx, sums, count, gamma, inv_std, samples, channels, spatial))
    return dx
