"""The order samples are visited in: a pure function of (seed, epoch, count), no MPI.

Global shuffle (the default): epoch ``e`` visits the split in the permutation
``PCG64(SeedSequence([seed, e, 0, 0]))`` of ``range(count)``, cut into global batches of
``batch_size`` (the last one smaller unless ``drop_last``).  Nothing here knows how many
ranks there are, so every rank layout sees the same batches, and the one-process run is
the reference for all of them (the project's invariant).

Local shuffle (MLPerf's node-local shards): the split is cut once into ``shards``
contiguous, fixed ranges, one per sample group, and each epoch permutes every shard on
its own; batch ``i``'s rows ``block_range(B', shards, g)`` (the rows sample group ``g``
holds) are the next items of shard ``g``'s permutation.  Every sample is still visited
exactly once per epoch and batch shapes are the global shuffle's, but samples never leave
their shard, so a node can keep just its shard.  The order then depends on the number of
shards: that is the price of staying node-local.
"""

from __future__ import annotations

import numpy as np

from cosmotrain.tensor.distribution import block_range

ORDER_STREAM = 0  # keeps room for other per-epoch random streams of the same seed


def permutation(seed: int, epoch: int, count: int, shard: int = 0) -> np.ndarray:
    """A permutation of ``range(count)`` that depends on ``(seed, epoch, shard)`` only."""
    sequence = np.random.SeedSequence([int(seed), int(epoch), ORDER_STREAM, int(shard)])
    return np.random.Generator(np.random.PCG64(sequence)).permutation(int(count))


def batch_sizes(count: int, batch_size: int, drop_last: bool = False) -> list[int]:
    """Sizes of an epoch's global batches: full ones, then the remainder unless dropped."""
    if batch_size < 1 or count < 0:
        raise ValueError(f"batch_size must be >= 1 and count >= 0, got {batch_size}, {count}")
    full, rest = divmod(count, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


def num_batches(count: int, batch_size: int, drop_last: bool = False) -> int:
    """Global batches per epoch."""
    return len(batch_sizes(count, batch_size, drop_last))


def shard_ranges(count: int, batch_size: int, shards: int) -> list[tuple[int, int]]:
    """The fixed ``[start, stop)`` range of the split each shard (sample group) keeps.

    Shard ``g`` holds exactly the rows group ``g`` takes from every batch of the epoch
    (``block_range`` of each batch size), so the shards feed the batches with nothing left
    over; they are contiguous so a file's sub-cubes stay together.
    """
    sizes = batch_sizes(count, batch_size)
    lengths = [sum(stop - start for start, stop in (_rows(b, shards, g) for b in sizes))
               for g in range(shards)]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    return [(int(starts[g]), int(starts[g + 1])) for g in range(shards)]


def epoch_batches(seed: int, epoch: int, count: int, batch_size: int, *,
                  shuffle: bool = True, shards: int = 1, drop_last: bool = False
                  ) -> list[np.ndarray]:
    """The global batches of one epoch: arrays of sample indices (int64), in order.

    ``shards=1`` is the global shuffle; ``shards > 1`` the local shuffle (module
    docstring).  ``shuffle=False`` keeps each shard in index order (validation).
    ``drop_last`` drops the final, smaller batch; its samples are then skipped this epoch.
    """
    sizes = batch_sizes(count, batch_size)
    streams = []
    for g, (start, stop) in enumerate(shard_ranges(count, batch_size, shards)):
        local = permutation(seed, epoch, stop - start, g) if shuffle else np.arange(stop - start)
        streams.append(start + local.astype(np.int64))
    taken = [0] * shards
    batches = []
    for size in sizes:
        parts = []
        for g in range(shards):
            start, stop = _rows(size, shards, g)
            parts.append(streams[g][taken[g]:taken[g] + stop - start])
            taken[g] += stop - start
        batches.append(np.concatenate(parts))
    return batches[:num_batches(count, batch_size, drop_last)]


def _rows(batch: int, shards: int, group: int) -> tuple[int, int]:
    """Rows of a global batch that sample group ``group`` holds (the readers' rule)."""
    return block_range(batch, shards, group)
