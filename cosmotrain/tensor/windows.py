"""Halo geometry of a sliding-window layer (convolution, pooling) on a partitioned tensor.

Convention: the input *and* the output of every layer are cut with the balanced
``block_range`` over the same grid.  Along one dimension, the rank owning output block
``[o0, o1)`` reads the input window range ``[a, b) = [o0*s - p_lo, (o1-1)*s - p_lo + k)``.
Against its owned input block ``[i0, i1)`` that gives

* ``halo_lo = i0 - lo`` and ``halo_hi = hi - i1`` where ``[lo, hi)`` is ``[a, b)`` clipped
  to the global input ``[0, G)``.  A positive halo is that many planes received from the
  direct neighbour; a **negative** halo means the rank owns planes it does not need
  (balanced input and output blocks do not line up when ``s > 1`` or the padding is
  asymmetric) and the local block is *cropped* on that side instead;
* ``pad_lo``/``pad_hi``: the part of ``[a, b)`` outside ``[0, G)``: true zero padding, only
  ever on the global boundary.

The rank then calls the ordinary local kernel on its *extended block* (owned block cropped
by negative halos, extended by received ones) with padding ``(pad_lo, pad_hi)`` and gets
exactly its output block.  ``HaloPlan`` says what each rank sends and receives; forward
copies the planes into the margins, backward sends the margin gradients back and adds them
to the owners' planes, so one plan serves both directions.

The window arithmetic (``window_span``: which planes a run of outputs reads, and its
padding) lives here; ``output_size`` stays in ``kernels/geometry.py`` because the kernels
size their outputs with it too, and ``kernels/`` sits below ``tensor/`` (it may not import
``tensor/``).  One rank's halo buffer along D, H and W is in ``tensor/halo_buffers.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cosmotrain.kernels.geometry import output_size
from cosmotrain.tensor.distribution import Distribution, block_range

_DIM_NAMES = "NCDHW"


@dataclass(frozen=True)
class WindowHalo:
    """The window geometry of one rank along one dimension (global plane indices)."""

    halo_lo: int  # planes wanted from rank r-1 (< 0: crop that many of my first planes)
    halo_hi: int  # planes wanted from rank r+1 (< 0: crop that many of my last planes)
    pad_lo: int  # zero planes before the extended block (global boundary only)
    pad_hi: int  # zero planes after it
    out_range: tuple[int, int]  # my output block [o0, o1)
    in_range: tuple[int, int]  # input planes the windows read, clipped to [0, G)
    own_range: tuple[int, int]  # my owned input block [i0, i1)

    @property
    def recv_lo(self) -> int:
        """Planes received from the lower neighbour (into the low margin)."""
        return max(self.halo_lo, 0)

    @property
    def recv_hi(self) -> int:
        """Planes received from the upper neighbour (into the high margin)."""
        return max(self.halo_hi, 0)

    @property
    def owned(self) -> int:
        """Number of input planes this rank owns."""
        return self.own_range[1] - self.own_range[0]


def _check_window(size: int, parts: int, kernel: int, stride: int,
                  padding: tuple[int, int]) -> None:
    """Reject arguments no layer can have, naming the offending value."""
    if size < 1 or parts < 1 or kernel < 1 or stride < 1 or min(padding) < 0:
        raise ValueError(f"window needs size, parts, kernel, stride >= 1 and padding >= 0; "
                         f"got size={size}, parts={parts}, kernel={kernel}, "
                         f"stride={stride}, padding={tuple(padding)}")
    if output_size(size, kernel, stride, *padding) < 1:
        raise ValueError(f"input size {size} with padding {tuple(padding)} is smaller than "
                         f"the kernel {kernel}")


def window_span(out: tuple[int, int], size: int, kernel: int, stride: int, pad_lo: int
                ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The planes of ``[0, size)`` that outputs ``[o0, o1)`` read, and the padding they need.

    The unclipped window range ``[a, b) = [o0*s - pad_lo, (o1-1)*s - pad_lo + k)`` is
    clipped to ``[0, size)``; what was clipped is the ``(lo, hi)`` zero padding, so a
    kernel call on those planes with that padding yields exactly ``o1 - o0`` planes:
    ``(b - a - k) // s + 1``.
    """
    a = out[0] * stride - pad_lo
    b = (out[1] - 1) * stride - pad_lo + kernel
    lo, hi = min(max(a, 0), size), min(max(b, 0), size)
    pads = max(0, min(b, 0) - a), max(0, b - max(a, size))
    return (lo, max(lo, hi)), pads


def plane_runs(out_len: int, size: int, kernel: int, stride: int, pad_lo: int,
               max_planes: int) -> list[tuple[tuple[int, int], tuple[int, int],
                                              tuple[int, int]]]:
    """Outputs ``[0, out_len)`` cut in runs whose windows read at most ``max_planes`` of
    the ``size`` input planes (at least one output a run): ``(outputs, input planes,
    padding)`` of each run, as :func:`window_span` gives them.

    Why: a window layer may compute its output a run of planes at a time, each from its
    own small slab of the input, instead of from one input-sized copy.
    """
    per_run = max(1, (max_planes - kernel) // stride + 1)
    runs = []
    for start in range(0, out_len, per_run):
        out = (start, min(out_len, start + per_run))
        runs.append((out, *window_span(out, size, kernel, stride, pad_lo)))
    return runs


def _rank_halo(size: int, own: tuple[int, int], out: tuple[int, int], kernel: int,
               stride: int, pad_lo: int) -> WindowHalo:
    """One rank's halo: clip the window range to ``[0, G)``; empty needs crop everything."""
    if out[0] == out[1]:  # no output: needs nothing, crops its whole block
        return WindowHalo(0, own[0] - own[1], 0, 0, out, (own[0], own[0]), own)
    (lo, hi), pads = window_span(out, size, kernel, stride, pad_lo)
    if lo == hi:  # windows read padding only: pin the empty range inside my block
        lo = hi = min(max(lo, own[0]), own[1])
    return WindowHalo(own[0] - lo, hi - own[1], pads[0], pads[1], out, (lo, hi), own)


def window_halos(size: int, parts: int, kernel: int, stride: int,
                 padding: tuple[int, int]) -> list[WindowHalo]:
    """The ``WindowHalo`` of every rank along one dimension of ``parts`` ways."""
    _check_window(size, parts, kernel, stride, padding)
    out_size = output_size(size, kernel, stride, *padding)
    return [_rank_halo(size, block_range(size, parts, r), block_range(out_size, parts, r),
                       kernel, stride, padding[0])
            for r in range(parts)]


def check_halos(halos: Sequence[WindowHalo], dim: str = "spatial") -> None:
    """Raise ``ValueError`` unless every halo comes from a direct neighbour's block.

    The exchange talks only to ranks r-1 and r+1, so a halo wider than the neighbour's
    block (too many ways for the input size) would need a second hop that does not exist.
    """
    for r, h in enumerate(halos):
        if h.out_range[0] < h.out_range[1] and h.owned == 0:
            raise ValueError(f"dimension {dim}, rank {r}: the input block is empty but the "
                             f"output block {h.out_range} is not; split dimension {dim} "
                             "fewer ways")
        for side, want, nb in (("lower", h.recv_lo, r - 1), ("upper", h.recv_hi, r + 1)):
            have = halos[nb].owned if 0 <= nb < len(halos) else 0
            if want > have:
                raise ValueError(f"dimension {dim}, rank {r}: the {side} neighbour's block "
                                 f"(rank {nb}, {have} planes) is smaller than the halo of "
                                 f"{want} planes; split dimension {dim} fewer ways or use "
                                 "a larger input")


def extended_range(halo: WindowHalo) -> tuple[int, int]:
    """``[start, stop)`` of the extended block inside the halo buffer.

    The buffer is ``[low margin (recv_lo) | owned block | high margin (recv_hi)]``; a
    negative halo moves ``start`` right of the margin (or ``stop`` left of it), cropping.
    """
    start = halo.recv_lo - halo.halo_lo
    return start, start + halo.in_range[1] - halo.in_range[0]


@dataclass(frozen=True)
class HaloPlan:
    """What one rank exchanges along one dimension; ``send_*`` index its owned block.

    Forward (replace): ``buffer[margin_lo] <- r-1's own[send_hi]`` and
    ``buffer[margin_hi] <- r+1's own[send_lo]``.  Backward (add): the margin gradients
    travel the other way and are *added* to those same owned planes.
    """

    owned: int
    recv_lo: int  # planes from r-1 into the low margin
    recv_hi: int  # planes from r+1 into the high margin
    send_lo: slice  # my first planes, which r-1 needs as its high margin
    send_hi: slice  # my last planes, which r+1 needs as its low margin
    extended: slice  # the extended block inside the buffer

    @property
    def buffer_size(self) -> int:
        """Planes in the buffer: low margin + owned block + high margin."""
        return self.recv_lo + self.owned + self.recv_hi

    @property
    def own(self) -> slice:
        """The owned block inside the buffer."""
        return slice(self.recv_lo, self.recv_lo + self.owned)

    @property
    def margin_lo(self) -> slice:
        """The low margin inside the buffer."""
        return slice(0, self.recv_lo)

    @property
    def margin_hi(self) -> slice:
        """The high margin inside the buffer."""
        return slice(self.recv_lo + self.owned, self.buffer_size)


def halo_plans(halos: Sequence[WindowHalo], dim: str = "spatial") -> list[HaloPlan]:
    """One ``HaloPlan`` per rank along a dimension (validated with ``check_halos``)."""
    check_halos(halos, dim)
    plans = []
    for r, h in enumerate(halos):
        to_lo = halos[r - 1].recv_hi if r > 0 else 0
        to_hi = halos[r + 1].recv_lo if r + 1 < len(halos) else 0
        plans.append(HaloPlan(h.owned, h.recv_lo, h.recv_hi, slice(0, to_lo),
                              slice(h.owned - to_hi, h.owned),
                              slice(*extended_range(h))))
    return plans


def spatial_halos(dist: Distribution, kernel: Sequence[int], stride: Sequence[int],
                  padding: Sequence[tuple[int, int]],
                  dims: Sequence[int] = (2, 3, 4)) -> list[list[WindowHalo]]:
    """Validated ``window_halos`` for each of ``dims`` of ``dist`` (default D, H, W).

    ``kernel``, ``stride`` and ``padding`` give one entry per listed dimension.
    """
    if not len(kernel) == len(stride) == len(padding) == len(dims):
        raise ValueError(f"need one kernel, stride and padding entry per dimension {tuple(dims)}; "
                         f"got {tuple(kernel)}, {tuple(stride)}, {tuple(padding)}")
    result = []
    for d, k, s, p in zip(dims, kernel, stride, padding):
        halos = window_halos(dist.global_shape[d], dist.grid[d], k, s, tuple(p))
        check_halos(halos, _dim_name(d, dist.ndim))
        result.append(halos)
    return result


def _dim_name(dim: int, ndim: int) -> str:
    """``"D"`` etc. for a 5D (N, C, D, H, W) tensor, else the index."""
    return _DIM_NAMES[dim] if ndim == len(_DIM_NAMES) else str(dim)
