"""Interior / boundary-shell split of a convolution's output on one rank.

Why: the forward halo exchange of a convolution only fills the *margins* of the rank's
buffer, yet most output elements never read a margin plane.  Those (the *interior*) can
be computed while the messages travel; only the thin *shell* around them waits for the
exchange.  Everything here is pure integer geometry on one rank's *extended block* (the
input the local kernel reads: owned planes, cropped by negative halos, extended by
received margins; see ``tensor/windows.py``), so it is unit-tested without MPI.

Conventions: boxes (``tensor/boxes.py``) have one range per spatial dimension (D, H, W).
Output ranges are local output indices; input ranges are indices of the extended block.
Along a dimension, output ``o`` reads the extended-block planes
``[o*s - pad_lo, o*s - pad_lo + k)``; indices outside ``[0, length)`` are zero padding,
which only ever lies on the global boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cosmotrain.tensor.boxes import Box, Range, box_empty, box_shape, box_slices, onion
from cosmotrain.tensor.windows import HaloPlan, WindowHalo, window_span

Padding = tuple[tuple[int, int], ...]

# Up to this share of shell in the output, the interior is computed by one call over the
# *whole* output (the margins still zero), whose shell is then recomputed.  Why: the
# kernel reads contiguous inputs and writes whole contiguous outputs, so a separate
# interior call costs a copy of its input window, a temporary output and a copy into the
# block: two block-sized temporaries (forward+backward peak per rank, conv 16->32 on
# 64^3 split over 2 ranks: 48 vs 34 MiB) and, measured on the 2-core box (16->32 and
# 4->16 layers, blocks of 4 to 32 planes), about as much time as recomputing 1/8.
REDO_SHELL_MAX = 0.125


@dataclass(frozen=True)
class ConvDim:
    """One dimension of a rank's local convolution: output, extended block, owned part."""

    out_len: int  # local output planes
    ext_len: int  # planes of the extended block
    owned: Range  # the owned (non-margin) planes inside the extended block
    kernel: int
    stride: int
    pad_lo: int  # zero planes before the extended block (global boundary only)


def conv_dim(halo: WindowHalo, plan: HaloPlan, kernel: int, stride: int) -> ConvDim:
    """A rank's ``ConvDim`` from its window halo and halo plan along one dimension."""
    ext = plan.extended
    owned = max(plan.own.start, ext.start) - ext.start, min(plan.own.stop, ext.stop) - ext.start
    return ConvDim(halo.out_range[1] - halo.out_range[0], ext.stop - ext.start,
                   (owned[0], max(owned)), kernel, stride, halo.pad_lo)


def conv_dims(halos: Sequence[WindowHalo], plans: Sequence[HaloPlan], kernel: Sequence[int],
              stride: Sequence[int]) -> tuple[ConvDim, ...]:
    """A rank's ``ConvDim`` along each dimension (D, H, W) from its halos and plans."""
    return tuple(conv_dim(h, p, k, s) for h, p, k, s in zip(halos, plans, kernel, stride))


@dataclass(frozen=True)
class SubConv:
    """One kernel call: output sub-box, the input sub-window it reads and its padding."""

    out: Box
    inp: Box
    padding: Padding

    @property
    def reads_input(self) -> bool:
        """False when every window lies in the zero padding (the kernel needs >= 1 plane)."""
        return not box_empty(self.inp)


@dataclass(frozen=True)
class OverlapPlan:
    """The interior call (``None`` when the interior is empty) and the shell calls."""

    interior: SubConv | None
    shell: tuple[SubConv, ...]

    @property
    def shell_fraction(self) -> float:
        """The share of the output in the shell (0 without shell, 1 without interior)."""
        shell = sum(math.prod(box_shape(sub.out)) for sub in self.shell)
        inner = math.prod(box_shape(self.interior.out)) if self.interior else 0
        return shell / (shell + inner) if shell else 0.0


def input_window(out: Range, dim: ConvDim) -> tuple[Range, tuple[int, int]]:
    """The extended-block planes that outputs ``[o0, o1)`` read, and the padding they need.

    The windows' planes clipped to ``[0, ext_len)``, and what was clipped as the call's
    ``(lo, hi)`` zero padding (:func:`~cosmotrain.tensor.windows.window_span`), so the
    call yields exactly ``o1 - o0`` planes.
    """
    return window_span(out, dim.ext_len, dim.kernel, dim.stride, dim.pad_lo)


def interior_range(dim: ConvDim) -> Range:
    """The outputs whose windows read no margin plane (owned planes and padding only).

    A side with a margin (``owned`` does not reach the block's end) admits outputs whose
    window starts at or after ``owned[0]`` (ends at or before ``owned[1]``); a side without
    one admits them all.  The range is empty when no output qualifies.
    """
    (own_lo, own_hi), s = dim.owned, dim.stride
    first = 0 if own_lo <= 0 else -(-(own_lo + dim.pad_lo) // s)
    last = dim.out_len if own_hi >= dim.ext_len else (own_hi + dim.pad_lo - dim.kernel) // s + 1
    first, last = max(first, 0), min(last, dim.out_len)
    return (first, last) if first < last else (0, 0)


def sub_conv(out: Box, dims: tuple[ConvDim, ...]) -> SubConv:
    """The kernel call computing the output sub-box ``out``."""
    windows = [input_window(r, d) for r, d in zip(out, dims)]
    return SubConv(out, tuple(w for w, _ in windows), tuple(p for _, p in windows))


def overlap_plan(dims: tuple[ConvDim, ...]) -> OverlapPlan:
    """The interior call and the shell calls (at most 6) that tile the whole output."""
    full: Box = tuple((0, d.out_len) for d in dims)
    interior: Box = tuple(interior_range(d) for d in dims)
    shell = tuple(sub_conv(box, dims) for box in onion(full, interior))
    return OverlapPlan(None if box_empty(interior) else sub_conv(interior, dims), shell)


def run_sub_conv(conv: Callable[[Any, Padding], Any], ext: Any, sub: SubConv, y: Any,
                 padding_only: Callable[[Any], None] | None = None) -> None:
    """Write ``conv(window, padding)`` into ``y``'s sub-box.

    ``conv`` is the local kernel on ``ext``'s layout (N, C, D, H, W).  The kernel rejects
    empty inputs, so a window that reads only padding is not convolved: its products are
    all zero, and ``padding_only(out)`` writes what the layer adds to them (its bias, then
    a fused activation of it) into the sub-box ``out``; zeros without one.
    """
    out = y[box_slices(sub.out)]
    if sub.reads_input:
        out[...] = conv(ext[box_slices(sub.inp)], sub.padding)
    elif padding_only is not None:
        padding_only(out)
    else:
        out[...] = 0
