"""DistTensor: this rank's block of a partitioned (N, C, D, H, W) tensor.

The block is owned data only; halo margins live in per-layer buffers built by the halo
exchange, so a rank allocates its block and the margins it needs, never a whole sample.
``scatter`` / ``gather`` move between a full array and the blocks (tests, I/O, predict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.device.xp import to_host
from cosmotrain.tensor.distribution import Distribution


@dataclass
class DistTensor:
    """``data`` is the block of ``dist`` at grid coordinate ``coord``."""

    data: Any
    dist: Distribution
    coord: tuple[int, ...]

    def __post_init__(self) -> None:
        expected = self.dist.local_shape(self.coord)
        if tuple(self.data.shape) != expected:
            raise ValueError(f"block of shape {tuple(self.data.shape)} does not match the "
                             f"distribution's block {expected} at {self.coord}")

    def copy(self) -> DistTensor:
        return DistTensor(self.data.copy(), self.dist, self.coord)

    def __iadd__(self, other: DistTensor) -> DistTensor:
        """Element-wise sum of two blocks of one distribution (residual connections)."""
        if other.dist != self.dist or other.coord != self.coord:
            raise ValueError(f"cannot add a block of {other.dist} at {other.coord} to one of "
                             f"{self.dist} at {self.coord}")
        self.data += other.data
        return self

    @property
    def offset(self) -> tuple[int, ...]:
        return self.dist.offset(self.coord)

    @classmethod
    def scatter(cls, full: Any, dist: Distribution, coord: tuple[int, ...]) -> DistTensor:
        """This rank's block of a full array that every rank holds (a copy)."""
        if tuple(full.shape) != dist.global_shape:
            raise ValueError(f"array of shape {tuple(full.shape)} is not the distribution's "
                             f"global shape {dist.global_shape}")
        return cls(full[dist.block(coord)].copy(), dist, coord)

    def gather(self, comm: Any, root: int | None = 0) -> Any:
        """The full array on ``root`` (None elsewhere); on every rank when ``root`` is None.

        Every rank of ``comm`` must hold a distinct block of the same distribution.
        The result is a host (numpy) array whatever device the blocks live on.
        """
        item = (self.coord, np.asarray(to_host(self.data)))
        blocks = comm.allgather(item) if root is None else comm.gather(item, root=root)
        if blocks is None:
            return None
        full = np.empty(self.dist.global_shape, dtype=item[1].dtype)
        seen = set()
        for coord, block in blocks:
            seen.add(tuple(coord))
            full[self.dist.block(coord)] = block
        if len(seen) != self.dist.size:
            raise ValueError(f"gather got {len(seen)} distinct blocks of {self.dist.size}: the "
                             "communicator must hold exactly one rank per block")
        return full
