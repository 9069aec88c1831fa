"""Which block of every global batch a rank receives, and which ranks hold the same block.

The input of a global batch of ``B'`` samples is the tensor (B', C, W, W, W) cut like
``Distribution((B', C, W, W, W), ways)``: rows go to sample groups by
``block_range(B', ways[0], coord[0])``, the channel coordinate is an opaque block index
along C, and the three spatial coordinates pick the spatial block.  Ranks that differ only
in a dimension the input is not split along (filter groups, say) hold the same block:
they are *replicas*, and the readers read such a block once and share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cosmotrain.data.formats.interface import Box
from cosmotrain.tensor.distribution import Distribution, block_owner, block_range

INPUT_DIMS = 5  # (sample, channel, depth, height, width)


@dataclass(frozen=True)
class BlockPlacement:
    """This rank's grid ``coord`` in ``ways`` over (sample, channel, depth, height, width)."""

    ways: tuple[int, ...]
    coord: tuple[int, ...]
    channels: int
    width: int

    def __post_init__(self) -> None:
        if len(self.ways) != INPUT_DIMS or len(self.coord) != INPUT_DIMS:
            raise ValueError(f"ways {self.ways} and coord {self.coord} need {INPUT_DIMS} "
                             "entries: (sample, channel, depth, height, width)")
        if not all(0 <= c < w for c, w in zip(self.coord, self.ways)):
            raise ValueError(f"coord {self.coord} is outside the grid {self.ways}")

    @classmethod
    def from_distribution(cls, dist: Distribution, coord: tuple[int, ...]) -> BlockPlacement:
        """From the model's ``input_distribution(shape)`` (global shape N, C, W, W, W)."""
        shape = dist.global_shape
        return cls(tuple(dist.grid), tuple(coord), shape[1], shape[2])

    @property
    def groups(self) -> int:
        """Sample groups (ways along the batch)."""
        return self.ways[0]

    @property
    def group(self) -> int:
        return self.coord[0]

    @property
    def block_key(self) -> tuple[int, ...]:
        """Which (channel, spatial) block of a sample this rank holds."""
        return tuple(self.coord[1:])

    def distribution(self, batch: int) -> Distribution:
        return Distribution((batch, self.channels, self.width, self.width, self.width),
                            self.ways)

    def rows(self, batch: int) -> tuple[int, int]:
        """``[start, stop)`` of the global batch's rows this rank's sample group holds."""
        return block_range(batch, self.ways[0], self.coord[0])

    def row_groups(self, batch: int) -> list[int]:
        """The sample group of every row of a global batch of ``batch`` samples."""
        return [block_owner(batch, self.ways[0], row) for row in range(batch)]

    @property
    def channel_slice(self) -> slice:
        return slice(*block_range(self.channels, self.ways[1], self.coord[1]))

    @property
    def box(self) -> Box:
        """The spatial block (D, H, W slices) of a model-width cube."""
        return tuple(slice(*block_range(self.width, w, c))  # type: ignore[return-value]
                     for w, c in zip(self.ways[2:], self.coord[2:]))

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """(c, d, h, w) of this rank's block of one sample."""
        spans = [self.channel_slice, *self.box]
        return tuple(s.stop - s.start for s in spans)  # type: ignore[return-value]

    @property
    def block_size(self) -> int:
        return math.prod(self.block_shape)


@dataclass(frozen=True)
class RankTable:
    """Every rank's placement coordinate, gathered once (collective)."""

    coords: tuple[tuple[int, ...], ...]  # by rank of the communicator
    replica: tuple[int, ...]  # index of each rank among the ranks with its coordinate
    replicas: int  # ranks per coordinate (the same for every coordinate)

    @classmethod
    def gather(cls, comm: Any, placement: BlockPlacement) -> RankTable:
        """Allgather the coordinates and check that they tile the grid evenly."""
        entries = comm.allgather((placement.ways, placement.coord))
        if any(ways != placement.ways for ways, _ in entries):
            raise ValueError(f"ranks disagree on the input grid: {sorted({w for w, _ in entries})}")
        coords = tuple(tuple(coord) for _, coord in entries)
        seen: dict[tuple[int, ...], int] = {}
        replica = []
        for coord in coords:
            replica.append(seen.get(coord, 0))
            seen[coord] = seen.get(coord, 0) + 1
        if len(seen) != math.prod(placement.ways) or len(set(seen.values())) != 1:
            raise ValueError(f"the {len(coords)} ranks do not hold every block of the grid "
                             f"{placement.ways} the same number of times")
        return cls(coords, tuple(replica), next(iter(seen.values())))

    def index(self, coord: tuple[int, ...]) -> int:
        """Row-major index of a grid coordinate among all coordinates (a split colour)."""
        return sorted(set(self.coords)).index(tuple(coord))
