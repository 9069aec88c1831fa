"""A parallel strategy as the planner sees it, and every strategy that fits P ranks.

A :class:`Strategy` is what a config's ``parallel`` section says: how many ways the
samples, channels, filters and the three spatial dimensions are split, where spatial
parallelism stops and which channel/filter algorithm the convolutions use.  The planner
enumerates them (:func:`enumerate_strategies`), the cost model prices them, and
``--apply`` writes the winner back as a ``parallel`` section.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from cosmotrain.config.parallel import ParallelLayout
from cosmotrain.config.schema import AUTO, Config
from cosmotrain.errors import UserError

AXES = ("sample", "channel", "filter", "depth", "height", "width")
TAGS = ("N", "C", "F", "D", "H", "W")
_NAME = re.compile(r"^((?:[NCFDHW]\d+)+)(?::(x|y|w|auto))?(?:@([\w.]+))?$")


@dataclass(frozen=True)
class Strategy:
    """Ways per dimension, the spatial stop and the channel/filter algorithm."""

    sample: int = 1
    channel: int = 1
    filter: int = 1
    depth: int = 1
    height: int = 1
    width: int = 1
    spatial_until: str = AUTO
    channel_algorithm: str = AUTO

    @property
    def ways(self) -> tuple[int, ...]:
        return (self.sample, self.channel, self.filter, self.depth, self.height, self.width)

    @property
    def size(self) -> int:
        total = 1
        for ways in self.ways:
            total *= ways
        return total

    @property
    def spatial(self) -> tuple[int, int, int]:
        return (self.depth, self.height, self.width)

    @property
    def group(self) -> int:
        """Ranks of a channel/filter group."""
        return self.channel * self.filter

    def describe(self) -> str:
        """``N2D2``-style name, ``:algorithm`` when channels are split and ``@stop`` when
        not automatic (what :func:`parse_strategy` reads)."""
        name = "".join(f"{tag}{ways}" for tag, ways in zip(TAGS, self.ways) if ways > 1)
        name = name or "N1"
        if self.group > 1:
            name += f":{self.channel_algorithm}"
        if self.spatial_until != AUTO:
            name += f"@{self.spatial_until}"
        return name

    def parallel_section(self) -> dict[str, object]:
        """The ``parallel`` section (only the keys that differ from the defaults)."""
        section: dict[str, object] = {"sample": self.sample}
        for axis, ways in zip(AXES[1:], self.ways[1:]):
            if ways > 1:
                section[axis] = ways
        if self.group > 1:
            section["channel_algorithm"] = self.channel_algorithm
        if self.spatial_until != AUTO:
            section["spatial_until"] = self.spatial_until
        return section

    def overrides(self) -> list[str]:
        """``--set`` items that select this strategy (every axis, so nothing is inherited)."""
        items = [f"parallel.{axis}={ways}" for axis, ways in zip(AXES, self.ways)]
        return items + [f"parallel.spatial_until={self.spatial_until}",
                        f"parallel.channel_algorithm={self.channel_algorithm}"]

    @classmethod
    def from_layout(cls, layout: ParallelLayout, cfg: Config) -> Strategy:
        """The strategy a resolved config runs."""
        return cls(layout.sample, layout.channel, layout.filter, layout.depth, layout.height,
                   layout.width, cfg.parallel.spatial_until, cfg.parallel.channel_algorithm)


def parse_strategy(text: str) -> Strategy:
    """``N2D2``, ``C2F2:w``, ``D2H2@pool4`` (ways per tag, ``:algorithm``, ``@stop``)."""
    match = _NAME.match(text.strip())
    if not match:
        raise UserError(f"strategy {text!r} is not understood; write ways per dimension "
                        f"as N2D2, C2F2:w or D2H2@pool4 (tags N C F D H W, optional "
                        f":x|y|w|auto and @first-layer-on-whole-samples)")
    ways = dict.fromkeys(TAGS, 1)
    for tag, count in re.findall(r"([NCFDHW])(\d+)", match.group(1)):
        ways[tag] *= int(count)
    if min(ways.values()) < 1:
        raise UserError(f"strategy {text!r}: ways must be at least 1")
    return Strategy(*(ways[t] for t in TAGS), spatial_until=match.group(3) or AUTO,
                    channel_algorithm=match.group(2) or AUTO)


def factorisations(ranks: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered ``parts``-tuple of positive integers whose product is ``ranks``."""
    if parts == 1:
        yield (ranks,)
        return
    for first in range(1, ranks + 1):
        if ranks % first == 0:
            for rest in factorisations(ranks // first, parts - 1):
                yield (first, *rest)


def enumerate_strategies(ranks: int, batch: int, width: int, channels_limit: int,
                         algorithms: tuple[str, ...] = ("x", "y", "w"),
                         min_block: int = 4) -> Iterator[Strategy]:
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
        if any(s > 1 and width // s < min_block for s in (depth, height, wide)):
            continue
        if channel * flt == 1:
            yield Strategy(*ways)
            continue
        wanted = {"x": flt == 1, "y": channel == 1, "w": channel > 1 and flt > 1}
        for algorithm in algorithms:
            if wanted[algorithm]:
                yield Strategy(*ways, channel_algorithm=algorithm)


def spatial_permutations_equal(a: Strategy, b: Strategy) -> bool:
    """Whether two strategies differ only by which spatial dimensions are split."""
    return (a.sample, a.channel, a.filter, a.channel_algorithm, a.spatial_until) == \
        (b.sample, b.channel, b.filter, b.channel_algorithm, b.spatial_until) and \
        sorted(a.spatial) == sorted(b.spatial)


def distinct(strategies: list[Strategy]) -> list[Strategy]:
    """One strategy per set of spatial permutations (D2 ~ H2 ~ W2 by symmetry of the
    volumes): the one that splits the outer dimensions first (D >= H >= W ways), since
    its blocks keep the long contiguous rows of the layout (N, C, D, H, W): on the 2-core
    development machine a block 16 voxels wide ran ``conv2`` 1.6x slower than a slab of
    the same size 64 wide (one thread), so the calibrated model can tell them apart."""
    kept: list[Strategy] = []
    for strategy in sorted(strategies, key=lambda s: tuple(-w for w in s.spatial)):
        if not any(spatial_permutations_equal(strategy, k) for k in kept):
            kept.append(strategy)
    return [s for s in strategies if s in kept]
