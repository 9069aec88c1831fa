"""The geometry of a 3D pooling call, shared by every pooling back end.

Conventions as for the convolutions: NCDHW arrays, ``kernel`` and ``stride`` triples (or
ints; ``stride=None`` means ``kernel``), asymmetric padding ``((lo, hi),) * 3``.
:class:`PoolGeometry` validates a call and answers what the back ends ask of it: the
output shape, the taps of a window that read real input, the chunks of whole channels the
CPU workers take, and whether a volume is reduced whole or one output plane at a time
(:func:`pools_by_planes`).
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.geometry import (Padding, Triple, check_batch_shape, normalize_padding,
                                         normalize_triple, output_shape)
from cosmotrain.kernels.route import route

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
    compiled loops keep these orders).  False for device arrays (:mod:`.cuda.pool`)."""
    where = route(like)
    if where.device:
        return False
    itemsize = 4 if where.bf16 else like.dtype.itemsize
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
        balanced = max(-(-c // -(-2 * workers.num_workers() // n)), -(-MIN_CHUNK_BYTES // volume))
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


def check_pooled_grad(dy: np.ndarray, pool: PoolGeometry) -> None:
    if dy.shape != pool.y_shape:
        raise ValueError(f"dy shape {dy.shape} does not match the pooling of x {pool.x_shape} "
                         f"(kernel {pool.kernel}, stride {pool.stride}, padding {pool.padding}): "
                         f"expected {pool.y_shape}")

