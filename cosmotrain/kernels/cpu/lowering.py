"""Lowering a convolution chunk to GEMMs plus a few shifted adds.

Plain im2col (``shift = 0``) puts all ``kD*kH*kW`` kernel offsets into the GEMM's
reduction: the column matrix has ``C*kD*kH*kW`` rows.  A *split* lowering keeps only the
leading kernel dimensions in the reduction and moves the last ``shift`` ones (W, or H and
W) to the output side: the GEMM produces one row per (output channel, shifted offset) on
an output grid extended by ``k - 1`` in the shifted dimensions, and

    y[o, z, h, w] = sum_{b, e} T[(o, b, e), z, h + b, w + e]

adds them up.  Why: on thin layers the plain GEMM is short and wide (F=16 x K=108 for
conv 4->16) and its column matrix is 27 copies of the input; the split GEMM has a better
shape (48 x 36: 103 vs 88 GFLOP/s per core with OpenBLAS's Haswell kernels) and needs 3x
fewer copies, for ``kW`` contiguous adds.  Measured on 2 cores, forward 128^3 4->16:
58 vs 71 ms; 64^3 16->32: 44 vs 57 ms.  With H and W split (used for the data gradient,
whose output has few channels) the column matrix of one output plane is ``kD``
consecutive planes of the depth-major ``(depth, C, H', W')`` slab: no copy at all.

Shifted dimensions need unit stride, and the extension wastes ``(k - 1) / size`` of the
GEMM, so small outputs use plain im2col.  Every chunk first copies its input planes, with
their zero padding, into a depth-major slab (one copy per input plane); column matrices
are strided window views of it, copied once into scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.geometry import ConvGeometry


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


def depth_slab(geo: ConvGeometry, src_n: np.ndarray, z0: int, z1: int) -> np.ndarray:
    """Zero-padded depth-major slab ``(depth, C, H', W')`` read by output planes z0:z1.

    Filled once per chunk (each input plane copied once, not ``kD`` times).
    """
    (dl, _), (hl, _), (wl, _) = geo.padding
    _, depth, hs, ws = geo.slab_shape(z1 - z0)
    slab = workers.scratch("slab", (depth, geo.channels, hs, ws), src_n.dtype)
    fill_slab(slab.transpose(1, 0, 2, 3), src_n, (z0 * geo.stride[0] - dl, -hl, -wl))
    return slab


def _blocked_copy(w: np.ndarray, block: int = 8) -> np.ndarray:
    """C-contiguous copy of a 5-D weight view, ``block`` entries of axis 1 at a time.

    Why: the data gradient's flipped, transposed kernel (``w[:, :, ::-1, ::-1,
    ::-1].transpose(1, 0, ...)``), copied whole, gathers each output row from ``F``
    places ``C*27`` floats apart; in blocks of 8 the reads stay in few pages (512x256
    filters of 3^3: 2.9 ms instead of 7.5 ms, 2026-11-23, out of a 60 ms data gradient).
    """
    out = np.empty(w.shape, w.dtype)
    for i in range(0, w.shape[1], block):
        np.copyto(out[:, i:i + block], w[:, i:i + block])
    return out


def planes_view(a_n: np.ndarray, d0: int, d1: int) -> np.ndarray:
    """``(channels, (d1-d0)*plane)`` view of depth planes d0:d1 of one sample (no copy)."""
    plane = a_n.shape[2] * a_n.shape[3]
    return a_n.reshape(a_n.shape[0], -1)[:, d0 * plane:d1 * plane]


@dataclass(frozen=True)
class Lowering:
    """A convolution whose last ``shift`` kernel dimensions are summed by shifted adds."""

    geo: ConvGeometry
    shift: int  # 0 (plain im2col), 1 (W) or 2 (H and W)

    def __post_init__(self) -> None:
        if not 0 <= self.shift <= 2 or any(s != 1 for s in self.geo.stride[3 - self.shift:]):
            raise ValueError(f"cannot shift {self.shift} dims with stride {self.geo.stride}")

    @property
    def gemm_kernel(self) -> Tuple[int, int, int]:
        """Kernel extents reduced inside the GEMM (1 in the shifted dimensions)."""
        return self.geo.kernel[:3 - self.shift] + (1,) * self.shift  # type: ignore[return-value]

    @property
    def shift_kernel(self) -> Tuple[int, int]:
        """(kH, kW) extents summed by shifted adds (1 where not shifted)."""
        kh, kw = self.geo.kernel[1:]
        return (kh if self.shift == 2 else 1, kw if self.shift >= 1 else 1)

    @property
    def grid(self) -> Tuple[int, int]:
        """(H, W) of the GEMM's output grid: the output, extended in shifted dimensions."""
        (_, ho, wo), (bh, bw) = self.geo.out, self.shift_kernel
        return ho + bh - 1, wo + bw - 1

    @property
    def rows(self) -> int:
        """Reduction length K = C * prod(gemm_kernel)."""
        return self.geo.channels * int(np.prod(self.gemm_kernel))

    @property
    def outputs(self) -> int:
        """GEMM rows M = F * prod(shift_kernel)."""
        return self.geo.filters * int(np.prod(self.shift_kernel))

    @property
    def columns_per_plane(self) -> int:
        return self.grid[0] * self.grid[1]

    def weights(self, w: np.ndarray) -> np.ndarray:
        """``(outputs, rows)`` matrix of ``w[f, c, a, b, e]`` in this lowering's order.

        Rows ``(f, shifted offsets)``; columns ``(c, a, b, e)``, ``(c, a, b)`` or, for the
        depth-major shift 2, ``(a, c)``.
        """
        order = {0: (0, 1, 2, 3, 4), 1: (0, 4, 1, 2, 3), 2: (0, 3, 4, 2, 1)}[self.shift]
        if self.shift or w.flags.c_contiguous:
            return np.ascontiguousarray(w.transpose(order).reshape(self.outputs, self.rows))
        return _blocked_copy(w).reshape(self.outputs, self.rows)

    def weights_from_matrix(self, g: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`weights` for ``shift <= 1`` (the filter gradient)."""
        f, c, (kd, kh, kw) = self.geo.filters, self.geo.channels, self.geo.kernel
        if self.shift == 0:
            return g.reshape(f, c, kd, kh, kw)
        return g.reshape(f, kw, c, kd, kh).transpose(0, 2, 3, 4, 1)

    def slab(self, src_n: np.ndarray, z0: int, z1: int) -> np.ndarray:
        """:func:`depth_slab`: the column matrix of H-and-W-split output plane ``i`` is
        then the contiguous block ``slab[i:i + kD]``, rows ``(a, c)``."""
        return depth_slab(self.geo, src_n, z0, z1)

    def columns(self, slab: np.ndarray, first: int, planes: int) -> np.ndarray:
        """Column matrix (rows x planes*columns_per_plane) of ``planes`` output planes.

        ``first`` is the first plane's index within the chunk of ``slab``.  A view of the
        slab for the H-and-W split (one plane), else one strided copy into scratch.
        """
        sd = self.geo.stride[0]
        if self.shift == 2:
            assert planes == 1, "H-and-W split lowers one plane at a time"
            return slab[first * sd:first * sd + self.geo.kernel[0]].reshape(self.rows, -1)
        s_d, s_c, s_h, s_w = slab.strides
        st_d, st_h, st_w = self.geo.stride
        shape = (self.geo.channels,) + self.gemm_kernel + (planes,) + self.grid
        view = as_strided(slab[first * sd:], shape,
                          (s_c, s_d, s_h, s_w, s_d * st_d, s_h * st_h, s_w * st_w), writeable=False)
        cols = workers.scratch("cols", shape, slab.dtype)
        np.copyto(cols, view)
        return cols.reshape(self.rows, -1)

    def sum_shifts(self, t: np.ndarray, dst: np.ndarray) -> None:
        """``dst[o, z, h, w] = sum_{b, e} t[(o, b, e), z, h + b, w + e]`` (dst: one chunk)."""
        (bh, bw), (f, planes, ho, wo) = self.shift_kernel, dst.shape
        if bh * bw > 1:
            self._sum_flat_shifts(t, dst)
            return
        np.copyto(dst, t.reshape((f, planes) + self.grid)[:, :, :ho, :wo])

    def _sum_flat_shifts(self, t: np.ndarray, dst: np.ndarray) -> None:
        """:meth:`sum_shifts` on the flattened grid: offset (b, e) is a shift by
        ``b*gw + e`` elements of each row of ``t``, so every add reads whole contiguous
        rows (the sums at grid positions outside the output are computed, then dropped).

        Why: the shifted views have runs of only ``Wo`` floats, which numpy adds 2-3x
        slower (data gradient 64->32 at 64^3, H-and-W split: 1.7 ms a plane for the
        9-view sum, 0.6 ms flattened; forward 32->64 at 64^3, W split: 0.35 against
        0.17 ms a plane, 64->128 at 32^3: 0.27 against 0.22 ms, 2026-11-23).  Same sums
        in the same order: same results.
        """
        (bh, bw), (f, planes, ho, wo), (gh, gw) = self.shift_kernel, dst.shape, self.grid
        n = planes * gh * gw
        rows = t.reshape(f, bh * bw, n)
        offsets = [b * gw + e for b in range(bh) for e in range(bw)]
        span = n - offsets[-1]
        acc = workers.scratch("shift_sum", (f, n), t.dtype)
        head = acc[:, :span]
        np.add(rows[:, 0, :span], rows[:, 1, offsets[1]:offsets[1] + span], out=head)
        for k, off in enumerate(offsets[2:], start=2):
            np.add(head, rows[:, k, off:off + span], out=head)
        np.copyto(dst, acc.reshape(f, planes, gh, gw)[:, :, :ho, :wo])

    def spread_shifts(self, dy_chunk: np.ndarray) -> np.ndarray:
        """Transpose of :meth:`sum_shifts` for ``shift == 1`` (the filter gradient).

        ``out[(o, e), z, h, w'] = dy_chunk[o, z, h, w' - e]`` (0 outside), as a matrix.
        """
        (f, planes, ho, wo), bw = dy_chunk.shape, self.shift_kernel[1]
        out = workers.scratch("spread", (f, bw, planes, ho, self.grid[1]), dy_chunk.dtype)
        for e in range(bw):
            out[:, e, :, :, :e] = 0
            out[:, e, :, :, e + wo:] = 0
            out[:, e, :, :, e:e + wo] = dy_chunk
        return out.reshape(f * bw, -1)
