"""Every layout that fits P ranks, as the planner enumerates them.

A strategy is a :class:`~cosmotrain.config.layout.Layout` (what a config's ``parallel``
section says, named ``N2D2``, ``C2F2:w``, ``D2H2@pool4``).  The planner enumerates them
(:func:`enumerate_strategies`), the cost model prices them, and ``--apply`` writes the
winner back as a ``parallel`` section.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from cosmotrain.config.layout import MIN_BLOCK_PLANES, Layout, thin_splits


def factorisations(ranks: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered ``parts``-tuple of positive integers whose product is ``ranks``
    (over the divisors of ``ranks``, found once: not a loop over every integer up to it)."""
    yield from _factorisations(ranks, parts, divisors(ranks))


def _factorisations(ranks: int, parts: int, candidates: list[int]
                    ) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (ranks,)
        return
    for first in candidates:
        if first > ranks:
            break
        if ranks % first == 0:
            for rest in _factorisations(ranks // first, parts - 1, candidates):
                yield (first, *rest)


def divisors(number: int) -> list[int]:
    """The divisors of ``number``, ascending (trial division up to its square root)."""
    low = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return low + [number // d for d in reversed(low) if d * d != number]


def most_ranks(batch: int, width: int, channels_limit: int,
               min_block: int = MIN_BLOCK_PLANES) -> int:
    """The largest rank count any strategy of :func:`enumerate_strategies` can have: one
    sample group per cube of the batch, ``channels_limit`` channel/filter ranks and, per
    spatial dimension, one block per ``min_block`` planes.  A larger count has no strategy,
    so the planner refuses it before enumerating anything."""
    return batch * channels_limit * max(1, width // min_block) ** 3


def enumerate_strategies(ranks: int, batch: int, width: int, channels_limit: int,
                         algorithms: tuple[str, ...] = ("x", "y", "w"),
                         min_block: int = MIN_BLOCK_PLANES) -> Iterator[Layout]:
    """Strategies for ``ranks`` that can run a batch of ``batch`` cubes of ``width``.

    Filters what cannot work (the batch does not divide over the sample groups, a spatial
    block thinner than ``min_block`` planes, more channel/filter ranks than
    ``channels_limit``, the smallest convolution's channels); each channel/filter split
    comes once per algorithm: stationary-x as ``channel = G``, stationary-y as ``filter =
    G`` (they use the group as one axis whatever its factoring) and stationary-w on each
    factoring with both above 1.
    """
    for ways in factorisations(ranks, 6):
        sample, channel, flt, depth, height, wide = ways
        if batch % sample or channel * flt > channels_limit:
            continue
        if thin_splits((width,) * 3, (depth, height, wide), min_block):
            continue
        if channel * flt == 1:
            yield Layout(*ways)
            continue
        wanted = {"x": flt == 1, "y": channel == 1, "w": channel > 1 and flt > 1}
        for algorithm in algorithms:
            if wanted[algorithm]:
                yield Layout(*ways, channel_algorithm=algorithm)


def spatial_permutations_equal(a: Layout, b: Layout) -> bool:
    """Whether two strategies differ only by which spatial dimensions are split."""
    return (a.sample, a.channel, a.filter, a.channel_algorithm, a.spatial_until) == \
        (b.sample, b.channel, b.filter, b.channel_algorithm, b.spatial_until) and \
        sorted(a.spatial) == sorted(b.spatial)


def distinct(strategies: list[Layout]) -> list[Layout]:
    """One strategy per set of spatial permutations (D2 ~ H2 ~ W2 by symmetry of the
    volumes): the one that splits the outer dimensions first (D >= H >= W ways), since
    its blocks keep the long contiguous rows of the layout (N, C, D, H, W): on the 2-core
    development machine a block 16 voxels wide ran ``conv2`` 1.6x slower than a slab of
    the same size 64 wide (one thread), so the calibrated model can tell them apart."""
    kept: list[Layout] = []
    for strategy in sorted(strategies, key=lambda s: tuple(-w for w in s.spatial)):
        if not any(spatial_permutations_equal(strategy, k) for k in kept):
            kept.append(strategy)
    return [s for s in strategies if s in kept]
