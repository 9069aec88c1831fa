"""The parallel layout: one frozen :class:`Layout` value shared by config, planner and grid.

A layout says how many ways the samples, channels, filters and the three spatial
dimensions are split (:data:`AXES`), where spatial parallelism stops (``spatial_until``),
which channel/filter algorithm the convolutions use, and any per-convolution overrides
(``parallel.layers``).  The config's ``parallel`` section converts to it
(:meth:`Layout.from_config`, resolving ``sample: auto`` against the rank count) and back
(:meth:`Layout.to_config`); the planner and the scale study name it by its strategy name
(:meth:`Layout.describe`, :func:`parse_layout`: ``N4``, ``D2H2``, ``C2F2:w``,
``D2H2@pool4``); ``comm.grid.ProcessGrid`` is built from it.  ``Layout.size`` is the one
product of the ways.

Whether the spatial blocks fit
------------------------------
Every rule about spatial blocks that needs no built model uses :func:`thin_splits`: the
split dimensions (ways > 1) whose *thinnest block* (``size // ways``, the smallest block
``tensor.distribution.block_range`` cuts) is below a number of planes.  Three callers ask
it, with different floors:

* :meth:`Layout.validate` (config time, before the model exists): the input's thinnest
  block must be at least ``min_block`` planes (1 by default: no rank holds an empty input
  block along a split dimension);
* ``layers.hybrid.spatial_stop`` with ``parallel.spatial_until: auto``: a convolution or
  pooling whose input is thinner than :data:`MIN_BLOCK_PLANES` planes runs on whole
  samples instead (a cost choice: a k3 halo would be half the block);
* ``plan.strategy.enumerate_strategies``: the planner skips layouts whose input is thinner
  than :data:`MIN_BLOCK_PLANES` planes.

The exact rule is ``tensor.windows.check_halos``, per convolution and pooling, which needs
the model: every halo plane must come from the direct neighbour's block.  It is applied
when the halo plans are built and, for a named ``spatial_until``, when the model is built
(``layers.hybrid.check_block_halos``).  How the two relate: the thinnest block bounds
every rank's block from below, so a layer whose widest halo is ``h`` planes passes the
exact rule whenever ``thin_splits(sizes, ways, h)`` is empty (with ``h >= 1``) -- the
cheap rule at floor ``h`` is sufficient for it.  At its config-time floor of 1 the cheap
rule is only the first step of that bound: a layout it accepts may still be refused,
layer by layer, by the exact rule (a stride-2 window on 1-plane blocks), and a layout it
refuses (more ways than planes) would pass the exact rule only where the ranks left
without input planes also have no output to compute.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cosmotrain.config.schema import AUTO, Config, LayerParallelConfig, ParallelConfig
from cosmotrain.errors import ConfigError, UserError

AXES = ("sample", "channel", "filter", "depth", "height", "width")
SPATIAL = AXES[3:]
TAGS = ("N", "C", "F", "D", "H", "W")
MIN_BLOCK_PLANES = 4  # the thinnest block auto keeps on spatial blocks (module docstring)
_NAME = re.compile(r"^((?:[NCFDHW]\d+)+)(?::(x|y|w|auto))?(?:@([\w.]+))?$")


@dataclass(frozen=True)
class LayerLayout:
    """One convolution's override (``parallel.layers.<name>``): its algorithm and, for
    stationary-w, the ways its input channels are split (None: the layout's own)."""

    name: str
    algorithm: str | None = None
    channel: int | None = None


@dataclass(frozen=True)
class Layout:
    """Ways per axis, the spatial stop, the channel/filter algorithm, per-layer overrides."""

    sample: int = 1
    channel: int = 1
    filter: int = 1
    depth: int = 1
    height: int = 1
    width: int = 1
    spatial_until: str = AUTO
    channel_algorithm: str = AUTO
    layers: tuple[LayerLayout, ...] = ()

    @property
    def ways(self) -> tuple[int, int, int, int, int, int]:
        """The ways of every axis, in :data:`AXES` order (the grid's shape)."""
        return (self.sample, self.channel, self.filter, self.depth, self.height, self.width)

    @property
    def size(self) -> int:
        """The number of ranks the layout needs: the product of its ways."""
        return math.prod(self.ways)

    @property
    def spatial(self) -> tuple[int, int, int]:
        return (self.depth, self.height, self.width)

    @property
    def group(self) -> int:
        """Ranks of a channel/filter group."""
        return self.channel * self.filter

    @property
    def layer_overrides(self) -> dict[str, LayerLayout]:
        """The per-convolution overrides by dotted layer name."""
        return {layer.name: layer for layer in self.layers}

    def describe(self) -> str:
        """``N2D2``-style name, ``:algorithm`` when channels are split and ``@stop`` when
        not automatic (what :func:`parse_layout` reads; per-layer overrides have no name)."""
        name = "".join(f"{tag}{ways}" for tag, ways in zip(TAGS, self.ways) if ways > 1)
        name = name or "N1"
        if self.group > 1:
            name += f":{self.channel_algorithm}"
        if self.spatial_until != AUTO:
            name += f"@{self.spatial_until}"
        return name

    @classmethod
    def parse(cls, text: str) -> Layout:
        """The layout a strategy name stands for (:func:`parse_layout`)."""
        return parse_layout(text)

    def parallel_section(self) -> dict[str, object]:
        """The ``parallel`` section as YAML data (only the keys that differ from the
        defaults)."""
        section: dict[str, object] = {"sample": self.sample}
        for axis, ways in zip(AXES[1:], self.ways[1:]):
            if ways > 1:
                section[axis] = ways
        if self.group > 1:
            section["channel_algorithm"] = self.channel_algorithm
        if self.spatial_until != AUTO:
            section["spatial_until"] = self.spatial_until
        if self.layers:
            section["layers"] = {layer.name: {"algorithm": layer.algorithm,
                                              "channel": layer.channel}
                                 for layer in self.layers}
        return section

    def overrides(self) -> list[str]:
        """``--set`` items that select this layout (every axis, so nothing is inherited;
        per-layer overrides are not part of a strategy and stay the config's)."""
        items = [f"parallel.{axis}={ways}" for axis, ways in zip(AXES, self.ways)]
        return items + [f"parallel.spatial_until={self.spatial_until}",
                        f"parallel.channel_algorithm={self.channel_algorithm}"]

    @classmethod
    def from_config(cls, section: ParallelConfig, ranks: int) -> Layout:
        """The layout a ``parallel`` section gives ``ranks`` ranks (``sample: auto`` takes
        what the other axes leave; raises when it cannot)."""
        rest = cls(1, section.channel, section.filter, section.depth, section.height,
                   section.width, section.spatial_until, section.channel_algorithm,
                   layers_of(section))
        return replace(rest, sample=_resolve_sample(section.sample, rest.size, ranks))

    def to_config(self, section: ParallelConfig) -> ParallelConfig:
        """``section`` with this layout's ways, stop, algorithm and overrides (the other
        keys of the section kept)."""
        return replace(section, sample=self.sample, channel=self.channel,
                       filter=self.filter, depth=self.depth, height=self.height,
                       width=self.width, spatial_until=self.spatial_until,
                       channel_algorithm=self.channel_algorithm,
                       layers={layer.name: LayerParallelConfig(layer.algorithm, layer.channel)
                               for layer in self.layers})

    def validate(self, ranks: int, batch_size: int, width: int, min_block: int = 1) -> None:
        """Refuse, with a :class:`ConfigError` naming the key, a layout that cannot run
        a batch of ``batch_size`` cubes of ``width`` on ``ranks`` ranks: the ways must
        multiply to ``ranks``, the batch divide over the sample groups, and no split leave
        an input block thinner than ``min_block`` planes (the module docstring says how
        this relates to the exact per-layer halo rule)."""
        if self.size != ranks:
            raise ConfigError("parallel", f"the groups multiply to {self.size} "
                              f"({self.describe()}) but the job has {ranks} rank(s)",
                              f"make the product equal {ranks} or set parallel.sample: auto")
        if batch_size % self.sample != 0:
            raise ConfigError("train.batch_size", f"{batch_size} does not divide over "
                              f"{self.sample} sample group(s)", f"use a multiple of {self.sample}")
        for index in thin_splits((width,) * 3, self.spatial, min_block):
            ways = self.spatial[index]
            raise ConfigError(f"parallel.{SPATIAL[index]}", f"splitting model.width={width} "
                              f"{ways} ways leaves blocks of {width // ways} plane(s), smaller "
                              f"than the halo of {min_block}",
                              f"use at most {width // min_block} ways")


def parse_layout(text: str) -> Layout:
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
    return Layout(*(ways[t] for t in TAGS), spatial_until=match.group(3) or AUTO,
                  channel_algorithm=match.group(2) or AUTO)


def layers_of(section: ParallelConfig) -> tuple[LayerLayout, ...]:
    """The per-convolution overrides of a ``parallel`` section, as layout values."""
    return tuple(LayerLayout(name, layer.algorithm, layer.channel)
                 for name, layer in section.layers.items())


def thin_splits(sizes: Sequence[int], ways: Sequence[int], planes: int) -> list[int]:
    """Indices of the split dimensions (ways > 1) whose thinnest block, ``size // ways``,
    is below ``planes``: the one cheap rule on spatial blocks (module docstring)."""
    return [index for index, (size, split) in enumerate(zip(sizes, ways))
            if split > 1 and size // split < planes]


def resolve_parallel(cfg: Config, world_size: int, min_block: int = 1) -> Layout:
    """``cfg.parallel`` as the layout of ``world_size`` ranks, validated against the
    config's batch and input (:meth:`Layout.validate`); every rank raises the same error.

    ``min_block`` is the smallest spatial block a rank may hold at the input.
    """
    layout = Layout.from_config(cfg.parallel, world_size)
    layout.validate(world_size, cfg.train.batch_size, cfg.model.width, min_block)
    return layout


def sample_groups(cfg: Config, world_size: int) -> int:
    """How many sample groups ``cfg.parallel`` makes of ``world_size`` ranks."""
    return Layout.from_config(cfg.parallel, world_size).sample


def _resolve_sample(sample: int | str, others: int, world_size: int) -> int:
    if sample != AUTO:
        return int(sample)
    if world_size % others != 0:
        raise ConfigError("parallel.sample", f"auto cannot fill {world_size} rank(s): the other "
                          f"groups (channel x filter x depth x height x width = {others}) "
                          f"do not divide it", f"run on a multiple of {others} ranks")
    return world_size // others
