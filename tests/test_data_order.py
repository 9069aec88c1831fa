"""The epoch order (pure): every sample exactly once, a function of (seed, epoch, count) only,
global batches with a smaller last one or dropped, and local shards that feed each sample
group's rows."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.data.readers import order
from cosmotrain.tensor.distribution import block_range


@pytest.mark.parametrize("count,batch", [(10, 4), (12, 4), (1, 3), (7, 1)])
def test_every_sample_exactly_once_with_a_smaller_last_batch(count: int, batch: int) -> None:
    for epoch in range(3):
        batches = order.epoch_batches(5, epoch, count, batch)
        assert [len(b) for b in batches] == order.batch_sizes(count, batch)
        assert all(len(b) == batch for b in batches[:-1]) and 0 < len(batches[-1]) <= batch
        assert sorted(np.concatenate(batches).tolist()) == list(range(count))
        assert len(batches) == order.num_batches(count, batch)


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    first = np.concatenate(order.epoch_batches(3, 0, 50, 8))
    assert np.array_equal(first, np.concatenate(order.epoch_batches(3, 0, 50, 8)))
    assert np.array_equal(first, np.concatenate(order.epoch_batches(3, 0, 50, 5)))
    assert np.array_equal(first, order.permutation(3, 0, 50))
    assert not np.array_equal(first, np.concatenate(order.epoch_batches(3, 1, 50, 8)))
    assert not np.array_equal(first, np.concatenate(order.epoch_batches(4, 0, 50, 8)))
    assert np.array_equal(np.concatenate(order.epoch_batches(3, 0, 50, 8, shuffle=False)),
                          np.arange(50))


def test_drop_last_drops_the_partial_batch() -> None:
    batches = order.epoch_batches(0, 0, 10, 4, drop_last=True)
    assert [len(b) for b in batches] == [4, 4] and order.num_batches(10, 4, True) == 2
    assert len(set(np.concatenate(batches).tolist())) == 8
    assert [len(b) for b in order.epoch_batches(0, 0, 8, 4, drop_last=True)] == [4, 4]


@pytest.mark.parametrize("count,batch,shards", [(22, 6, 2), (23, 8, 4), (5, 4, 4), (9, 3, 3)])
def test_local_shards_feed_each_groups_rows(count: int, batch: int, shards: int) -> None:
    ranges = order.shard_ranges(count, batch, shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for epoch in range(2):
        batches = order.epoch_batches(1, epoch, count, batch, shards=shards)
        assert sorted(np.concatenate(batches).tolist()) == list(range(count))
        for rows in batches:
            for group in range(shards):
                start, stop = block_range(len(rows), shards, group)
                lo, hi = ranges[group]
                assert all(lo <= s < hi for s in rows[start:stop])
    shuffled = [np.concatenate(order.epoch_batches(1, e, count, batch, shards=shards))
                for e in range(2)]
    assert count < 6 or not np.array_equal(*shuffled)


def test_each_shard_is_permuted_on_its_own() -> None:
    """Two equal shards must not visit their samples in the same relative order (each
    shard's permutation depends on the shard, as on the seed and the epoch)."""
    (lo0, hi0), (lo1, hi1) = order.shard_ranges(40, 8, 2)
    assert hi0 - lo0 == hi1 - lo1 == 20
    visited = np.concatenate(order.epoch_batches(3, 0, 40, 8, shards=2))
    first = [s - lo0 for s in visited if lo0 <= s < hi0]
    second = [s - lo1 for s in visited if lo1 <= s < hi1]
    assert first != second


def test_bad_batch_size_is_refused() -> None:
    with pytest.raises(ValueError):
        order.batch_sizes(10, 0)
