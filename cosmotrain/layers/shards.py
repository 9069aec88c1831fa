"""Blocks of sharded parameters and buffers, and how to reassemble the full arrays.

Under channel/filter parallelism a rank keeps only its block of each split layer's
weights (and so of their gradients and optimizer state).  A :class:`Shard` records where
the block sits in the full array, so checkpoints and tests can gather the full arrays
(PyTorch layout) and a resumed run can cut them again under another layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.device.xp import to_host

Index = tuple[Any, ...]  # per leading dimension: an index array or a slice


@dataclass(frozen=True)
class Shard:
    """A block of an array of ``global_shape``: ``full[np.ix_-style index]``."""

    global_shape: tuple[int, ...]
    index: Index

    def _mesh(self) -> tuple[Any, ...]:
        """The index as open-mesh arrays (``np.ix_``) over the leading dimensions."""
        axes = [np.arange(self.global_shape[d])[i] if isinstance(i, slice) else np.asarray(i)
                for d, i in enumerate(self.index)]
        return np.ix_(*axes)

    def take(self, full: Any) -> Any:
        """This block of ``full`` (a copy)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"array of shape {tuple(full.shape)} is not the sharded "
                             f"parameter's full shape {self.global_shape}")
        return np.ascontiguousarray(full[self._mesh()])

    def put(self, full: Any, block: Any) -> None:
        """Write ``block`` into its place in ``full``."""
        full[self._mesh()] = block


def gather_full(comm: Any, items: Iterable[tuple[str, Any, Shard | None]],
                root: int | None = None) -> dict[str, Any] | None:
    """Full arrays from every rank's blocks (collective over one channel/filter group).

    ``items`` are ``(name, local array, shard)``; unsharded arrays (shard None) are the
    same on every rank and returned as copies.  Every result is a new array, never a
    view of live state (gradient buckets are reused by the next step).  With ``root``
    only that rank assembles the arrays (the others get None): a checkpoint needs them
    once, not a full copy of the model on every rank.  Results are host (numpy) arrays,
    wherever the blocks live.
    """
    items = [(name, to_host(block), shard) for name, block, shard in items]
    sharded = [(name, np.asarray(block), shard) for name, block, shard in items
               if shard is not None]
    if comm.Get_size() == 1:
        everyone = [sharded]
    elif root is None:
        everyone = comm.allgather(sharded)
    else:
        everyone = comm.gather(sharded, root=root)
        if everyone is None:
            return None
    full = {name: np.array(block) for name, block, shard in items if shard is None}
    for name, block, shard in sharded:
        full[name] = np.zeros(shard.global_shape, dtype=block.dtype)
    for blocks in everyone:
        for name, block, shard in blocks:
            shard.put(full[name], block)
    return {name: full[name] for name, _, _ in items}
