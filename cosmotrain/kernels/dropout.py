"""Dropout masks that are a pure function of (seed, step, layer, global element index).

The mask of an element depends on its position in the *global* tensor, never on which
rank holds it, so every partitioning of the batch or the volume draws the same mask (the
invariant of DESIGN.md).  The generator is a counter-based hash (the splitmix64
finaliser) evaluated on the global linear index: no state, no sequence to keep in step.

On a device, contiguous float32 and bfloat16 arrays keep no mask at all: :func:`dropout_mask`
returns the mask's :class:`StreamMask` and ``kernels/cuda/src/dropout.cu`` recomputes the
same bits in the one pass that applies it, forward and backward (bf16 read and written as
stored).  The kernel reads the step count from device memory (the training step's
``Context.device_step``), so a captured CUDA graph draws a new mask at every replay.  The step then launches one kernel each way instead of the mask's dozen integer
passes and a select, and holds no boolean activation between forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.activation import device_kernel
from cosmotrain.kernels.cuda import raw_ops
from cosmotrain.kernels.route import route
from cosmotrain.precision import narrow, widen

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: Any) -> Any:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int, step: int, salt: int) -> np.uint64:
    """A 64-bit key for one (seed, step, layer) stream."""
    with np.errstate(over="ignore"):
        key = np.uint64(seed & (2**64 - 1))
        for word in (step, salt):
            key = _mix(np.asarray(key + _GOLDEN * np.uint64(word + 1)))[()]
    return np.uint64(key)


def global_linear_index(local_shape: Sequence[int], offset: Sequence[int],
                        global_shape: Sequence[int], xp: Any = np) -> Any:
    """Row-major index in the global tensor of every element of a local block."""
    index = xp.zeros((1,) * len(local_shape), dtype=xp.uint64)
    for axis, (n, start, total) in enumerate(zip(local_shape, offset, global_shape)):
        shape = [1] * len(local_shape)
        shape[axis] = n
        coord = xp.arange(start, start + n, dtype=xp.uint64).reshape(shape)
        index = index * xp.uint64(total) + coord
    return index


def dropout_keep_mask(local_shape: Sequence[int], offset: Sequence[int],
                      global_shape: Sequence[int], p: float, seed: int, step: int, salt: int,
                      xp: Any = np) -> Any:
    """Boolean mask (True = keep) for a local block at ``offset`` of ``global_shape``."""
    index = global_linear_index(local_shape, offset, global_shape, xp)
    key = stream_key(seed, step, salt)
    with np.errstate(over="ignore"):
        bits = _mix(index * _GOLDEN + key)
    uniform = (bits >> np.uint64(11)).astype(xp.float64) * (1.0 / 2**53)
    return uniform >= p


@dataclass(frozen=True)
class StreamMask:
    """:func:`dropout_keep_mask`'s mask by its arguments, for the device kernel to draw."""

    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    seed: int
    step: int
    salt: int
    device_step: Any = None  # ``step`` in device memory (float64), when the step keeps it

    def step_on(self, xp: Any) -> Any:
        """The step count as the kernel reads it: the step's device scalar, else this
        mask's ``step`` uploaded (a layer run outside the training step)."""
        if self.device_step is not None:
            return self.device_step
        return xp.asarray(np.asarray([float(self.step)]))

    def keep(self, x: Any, p: float) -> Any:
        """The boolean mask for an array of the block's shape (a strided gradient)."""
        return dropout_keep_mask(x.shape, self.offset, self.global_shape, p, self.seed,
                                 self.step, self.salt, array_module(x))


def dropout_mask(x: Any, offset: Sequence[int], global_shape: Sequence[int], p: float,
                 seed: int, step: int, salt: int, device_step: Any = None) -> Any:
    """What :func:`dropout_forward` and :func:`dropout_backward` take for the block ``x``:
    a :class:`StreamMask` where the device kernel applies it (``device_step``: ``step``
    in device memory), else the boolean mask."""
    if route(x).device and device_kernel(x) and x.ndim <= 5:
        return StreamMask(tuple(offset), tuple(global_shape), seed, step, salt, device_step)
    return dropout_keep_mask(x.shape, offset, global_shape, p, seed, step, salt,
                             array_module(x))


def dropout_forward(x: Any, keep: Any, p: float) -> Any:
    """Inverted dropout: kept elements scaled by 1 / (1 - p) (in float32 for bf16).
    ``keep``: the boolean mask, or a :class:`StreamMask` (:func:`dropout_mask`)."""
    if isinstance(keep, StreamMask):
        if device_kernel(x):
            return raw_ops.dropout(x, keep.offset, keep.global_shape, p, keep.seed,
                                   keep.salt, keep.step_on(array_module(x)))
        keep = keep.keep(x, p)
    where = route(x)
    if where.bf16:
        return narrow(dropout_forward(widen(x), keep, p))
    xp = array_module(x)
    scale = x.dtype.type(1.0 / (1.0 - p))
    return xp.where(keep, x * scale, x.dtype.type(0))


def dropout_backward(dy: Any, keep: Any, p: float) -> Any:
    """The same mask and scale applied to the gradient."""
    return dropout_forward(dy, keep, p)
