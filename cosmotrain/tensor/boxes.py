"""Boxes of array indices: the one box type of the distribution geometry (pure, no data).

A ``Range`` is ``(start, stop)``, the half-open interval ``[start, stop)``; a ``Box`` is
one range per dimension.  It is *empty* when some range has ``stop <= start``: boxes are
intersected and peeled without special cases, and a caller that needs "nothing" tests
:func:`box_empty` (the redistribution stores ``None`` for an empty box).  A box indexes
the trailing dimensions of an array through :func:`box_slices`, so the same box serves a
whole block (one range per dimension) and the spatial part of an (N, C, D, H, W) block.
"""

from __future__ import annotations

Range = tuple[int, int]
Box = tuple[Range, ...]


def box_empty(box: Box) -> bool:
    """True when the box holds no element."""
    return any(stop <= start for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    """The extent of each dimension (0 for empty ranges)."""
    return tuple(max(0, stop - start) for start, stop in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    """The box as a numpy index of an array's trailing dimensions (all, at the array's rank)."""
    return (Ellipsis,) + tuple(slice(start, stop) for start, stop in box)


def intersect(a: Box, b: Box) -> Box:
    """The common part of two boxes (possibly empty: ``stop <= start`` somewhere)."""
    return tuple((max(p[0], q[0]), min(p[1], q[1])) for p, q in zip(a, b))


def to_local(box: Box, block: Box) -> Box:
    """``box`` in the local indices of ``block`` (the box that starts at index 0 there)."""
    return tuple((start - o, stop - o) for (start, stop), (o, _) in zip(box, block))


def onion(outer: Box, inner: Box) -> list[Box]:
    """Disjoint non-empty slabs covering ``outer`` minus ``inner`` (``inner`` inside it).

    At most two slabs per dimension (6 for D, H, W), peeled dimension after dimension:
    the low and high slabs along D over the full H and W; then along H restricted to
    inner's D range; then along W restricted to inner's D and H ranges.  An empty
    ``inner`` gives ``[outer]``.
    """
    if box_empty(outer):
        return []
    if box_empty(inner):
        return [outer]
    slabs, core = [], list(outer)
    for dim, (lo, hi) in enumerate(inner):
        for part in ((core[dim][0], lo), (hi, core[dim][1])):
            slab = tuple(core[:dim]) + (part,) + tuple(core[dim + 1:])
            if not box_empty(slab):
                slabs.append(slab)
        core[dim] = (lo, hi)
    return slabs
