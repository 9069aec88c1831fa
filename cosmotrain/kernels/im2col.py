"""Convolution geometry, padded slabs, chunk planning and the im2col / col2im copies.

A *slab* is a few consecutive depth planes of one sample, copied with their zero padding
into a reusable per-thread buffer (:func:`fill_slab`); padding is thus never materialised
for the whole tensor.  im2col is then one ``np.copyto`` from a read-only 7-D strided
window view of the slab, shape ``(C, kD, kH, kW, s, Ho, Wo)``: row ``(c, kd, kh, kw)`` of
the column matrix holds channel ``c`` shifted by the kernel offset for the ``s`` output
planes of the chunk, in the row order of ``w.reshape(F, C*kD*kH*kW)``, so a chunk of
the convolution is one GEMM.  col2im is the transpose: one strided add per offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .geometry import Padding, PaddingLike, Triple, normalize_padding, normalize_triple, output_shape

Chunk = Tuple[int, int, int]  # (sample, first plane, end plane)


@dataclass(frozen=True)
class ConvGeometry:
    """Everything shape-related about one 3D convolution (validated on construction)."""

    batch: int
    channels: int
    filters: int
    spatial: Triple        # input (D, H, W), without padding
    kernel: Triple
    stride: Triple
    padding: Padding
    out: Triple            # output (Do, Ho, Wo)

    @classmethod
    def create(cls, x_shape: Sequence[int], w_shape: Sequence[int],
               stride: "int | Sequence[int]", padding: PaddingLike) -> "ConvGeometry":
        """Validate shapes; the ``ValueError`` names the offending argument."""
        x_shape, w_shape = tuple(int(v) for v in x_shape), tuple(int(v) for v in w_shape)
        if len(x_shape) != 5 or min(x_shape) < 1:
            raise ValueError(f"x shape must be (N, C, D, H, W) with positive sizes, got {x_shape}")
        if len(w_shape) != 5 or min(w_shape) < 1:
            raise ValueError(f"w shape must be (F, C, kD, kH, kW) with positive sizes, got {w_shape}")
        if x_shape[1] != w_shape[1]:
            raise ValueError(f"x has {x_shape[1]} channels but w expects {w_shape[1]} "
                             f"(x shape {x_shape}, w shape {w_shape})")
        kernel = w_shape[2:]
        stride, padding = normalize_triple(stride, "stride"), normalize_padding(padding)
        out = output_shape(x_shape[2:], kernel, stride, padding, what="x")
        return cls(x_shape[0], x_shape[1], w_shape[0], x_shape[2:], kernel, stride, padding, out)

    @property
    def x_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.channels) + self.spatial

    @property
    def w_shape(self) -> Tuple[int, ...]:
        return (self.filters, self.channels) + self.kernel

    @property
    def y_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.filters) + self.out

    @property
    def rows(self) -> int:
        """Rows of the column matrix: ``C * kD * kH * kW``."""
        return self.channels * int(np.prod(self.kernel))

    @property
    def plane(self) -> int:
        """Output positions in one output depth plane."""
        return self.out[1] * self.out[2]

    def slab_shape(self, planes: int) -> Tuple[int, int, int, int]:
        """Padded input slab ``(C, depth, Hp, Wp)`` read by ``planes`` output planes."""
        (sd, sh, sw), (_, ho, wo) = self.stride, self.out
        kd, kh, kw = self.kernel
        return (self.channels, (planes - 1) * sd + kd, (ho - 1) * sh + kh, (wo - 1) * sw + kw)

    def check(self, name: str, shape: Sequence[int], expected: Sequence[int]) -> None:
        if tuple(shape) != tuple(expected):
            raise ValueError(f"{name} shape {tuple(shape)} does not match the convolution "
                             f"(x {self.x_shape}, w {self.w_shape}, stride {self.stride}, "
                             f"padding {self.padding}): expected {tuple(expected)}")


def fill_slab(slab: np.ndarray, src: np.ndarray, origin: Sequence[int]) -> np.ndarray:
    """Copy ``src`` (C, D, H, W) into ``slab`` (C, d, h, w) as a zero-padded window.

    ``slab[:, i, j, k] = src[:, origin[0] + i, origin[1] + j, origin[2] + k]`` where that
    index is inside ``src``, else 0.  Origins may be negative (the padding side).  Only
    the border of the slab is zeroed, not the whole buffer.
    """
    box = []
    for o, n, m in zip(origin, src.shape[1:], slab.shape[1:]):
        lo, hi = min(max(-o, 0), m), max(min(n - o, m), 0)
        box.append((lo, max(lo, hi)))
    view = slab
    for axis, (lo, hi) in enumerate(box, start=1):
        index = [slice(None)] * 4
        index[axis] = slice(0, lo)
        view[tuple(index)] = 0
        index[axis] = slice(hi, None)
        view[tuple(index)] = 0
        index[axis] = slice(lo, hi)
        view = view[tuple(index)]
    src_index = tuple(slice(o + lo, o + hi) for o, (lo, hi) in zip(origin, box))
    view[...] = src[(slice(None),) + src_index]
    return slab


def planes_view(a_n: np.ndarray, d0: int, d1: int) -> np.ndarray:
    """``(channels, (d1-d0)*plane)`` view of depth planes d0:d1 of one sample (no copy)."""
    plane = a_n.shape[2] * a_n.shape[3]
    return a_n.reshape(a_n.shape[0], -1)[:, d0 * plane:d1 * plane]


def col2im_add(cols: np.ndarray, dxp_n: np.ndarray, geo: ConvGeometry, d0: int, d1: int) -> None:
    """Add the column matrix of output planes d0:d1 into the padded gradient ``dxp_n``.

    One strided add per kernel offset (the offsets' target views overlap each other, so
    they cannot be fused into one ufunc call).
    """
    (stD, stH, stW), (_, ho, wo) = geo.stride, geo.out
    s = d1 - d0
    cols7 = cols.reshape((geo.channels,) + geo.kernel + (s, ho, wo))
    for a in range(geo.kernel[0]):
        za = d0 * stD + a
        for b in range(geo.kernel[1]):
            for e in range(geo.kernel[2]):
                dst = dxp_n[:, za:za + (s - 1) * stD + 1:stD,
                            b:b + (ho - 1) * stH + 1:stH,
                            e:e + (wo - 1) * stW + 1:stW]
                np.add(dst, cols7[:, a, b, e], out=dst)


def plan_chunks(batch: int, depth: int, bytes_per_plane: int, budget_bytes: int,
                min_planes: int = 1) -> List[Chunk]:
    """Split each sample's ``depth`` planes into runs of about ``budget_bytes`` of buffers.

    All runs but the last of a sample have at least ``min_planes`` planes.
    """
    planes = max(min_planes, min(depth, budget_bytes // max(bytes_per_plane, 1)))
    count = -(-depth // planes)
    planes = max(min_planes, -(-depth // count))  # even out the run lengths
    return [(n, d0, min(depth, d0 + planes)) for n in range(batch)
            for d0 in range(0, depth, planes)]
