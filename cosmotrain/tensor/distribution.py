"""Which rank owns which block of a tensor: pure index math, no MPI, no data.

Every dimension (N, C, D, H, W) is cut into balanced contiguous blocks exactly like
``numpy.array_split``.  One rule for every tensor of every layer keeps the layers simple:
an output block always sits on the same grid coordinate as the input block it came from,
and any rank can compute anyone's block without communicating.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cosmotrain.tensor.boxes import Box


def block_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of block ``index`` of ``n`` items in ``parts`` balanced blocks.

    The first ``n % parts`` blocks are one item longer (numpy.array_split); with
    ``parts > n`` the trailing blocks are empty.
    """
    if n < 0 or parts < 1 or not 0 <= index < parts:
        raise ValueError(f"block_range needs n >= 0, parts >= 1, 0 <= index < parts; "
                         f"got n={n}, parts={parts}, index={index}")
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return start, start + size + (index < extra)


def block_owner(n: int, parts: int, index: int) -> int:
    """The block of ``block_range(n, parts, .)`` that holds item ``index``."""
    if not 0 <= index < n:
        raise ValueError(f"index {index} is outside [0, {n})")
    size, extra = divmod(n, parts)
    long_items = extra * (size + 1)  # items held by the longer leading blocks
    if index < long_items:
        return index // (size + 1)
    return extra + (index - long_items) // size


@dataclass(frozen=True)
class Distribution:
    """A tensor of ``global_shape`` cut into ``grid[d]`` balanced blocks along each dim.

    ``grid[d] == 1`` means dimension ``d`` is not split.  A *coordinate* is one index per
    dimension into the grid (the rank's position in the Cartesian process grid).
    """

    global_shape: tuple[int, ...]
    grid: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))
        if len(self.global_shape) != len(self.grid):
            raise ValueError(f"Distribution: global_shape {self.global_shape} has "
                             f"{len(self.global_shape)} dimensions but grid {self.grid} has "
                             f"{len(self.grid)}; give one grid entry per dimension")
        if any(n < 1 for n in self.global_shape):
            raise ValueError(f"Distribution: global_shape {self.global_shape} must have "
                             "sizes >= 1")
        if any(g < 1 for g in self.grid):
            raise ValueError(f"Distribution: grid {self.grid} must have ways >= 1 "
                             "(1 = dimension not split)")

    @property
    def ndim(self) -> int:
        """Number of tensor dimensions."""
        return len(self.grid)

    @property
    def size(self) -> int:
        """Number of blocks (ranks) in the grid."""
        count = 1
        for ways in self.grid:
            count *= ways
        return count

    def ranges(self, dim: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of every block along ``dim``, in grid order."""
        return [block_range(self.global_shape[dim], self.grid[dim], i)
                for i in range(self.grid[dim])]

    def _check_coord(self, coord: tuple[int, ...]) -> None:
        if len(coord) != self.ndim or not all(0 <= c < g for c, g in zip(coord, self.grid)):
            raise ValueError(f"grid coordinate {tuple(coord)} is outside grid {self.grid}")

    def box(self, coord: tuple[int, ...]) -> Box:
        """The block at grid ``coord`` as a box of global indices (``tensor/boxes.py``)."""
        self._check_coord(coord)
        return tuple(block_range(n, g, c) for n, g, c in zip(self.global_shape, self.grid, coord))

    def block(self, coord: tuple[int, ...]) -> tuple[slice, ...]:
        """Global index slices of the block at grid ``coord`` (``x[dist.block(c)]``)."""
        return tuple(slice(*r) for r in self.box(coord))

    def local_shape(self, coord: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the block at ``coord`` (some entries are 0 when ``grid[d] > n``)."""
        return tuple(s.stop - s.start for s in self.block(coord))

    def offset(self, coord: tuple[int, ...]) -> tuple[int, ...]:
        """Global index of the first element of the block at ``coord``."""
        return tuple(s.start for s in self.block(coord))

    def is_empty(self, coord: tuple[int, ...]) -> bool:
        """True when the block at ``coord`` holds no element."""
        return 0 in self.local_shape(coord)

    def coords(self) -> list[tuple[int, ...]]:
        """Every grid coordinate, row-major (last dimension fastest, like MPI Cart)."""
        return list(itertools.product(*(range(g) for g in self.grid)))

    def owner(self, dim: int, index: int) -> int:
        """Grid coordinate along ``dim`` of the block holding global ``index``."""
        return block_owner(self.global_shape[dim], self.grid[dim], index)

    def with_shape(self, global_shape: tuple[int, ...]) -> Distribution:
        """The same grid over another global shape (e.g. a layer's output)."""
        return Distribution(tuple(global_shape), self.grid)


def unsplit(dist: Distribution, coord: tuple[int, ...], dim: int, size: int
            ) -> tuple[Distribution, tuple[int, ...]]:
    """``dist`` and ``coord`` once every rank holds ``size`` items along ``dim`` (after an
    all-gather of the blocks there): ``dim`` not split (one block, coordinate 0), the other
    dimensions as they were."""
    shape, grid, at = list(dist.global_shape), list(dist.grid), list(coord)
    shape[dim], grid[dim], at[dim] = size, 1, 0
    return Distribution(tuple(shape), tuple(grid)), tuple(at)
