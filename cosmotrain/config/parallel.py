"""Resolve the ``parallel`` section against the MPI world size.

The product of the groups (sample x channel x filter x depth x height x width) must equal
the number of ranks; ``parallel.sample: auto`` takes what the other dimensions leave.  The
rules are checked identically on every rank, so every rank raises the same error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cosmotrain.config.schema import AUTO, Config
from cosmotrain.errors import ConfigError

SPATIAL_KEYS = ("depth", "height", "width")


@dataclass(frozen=True)
class ParallelLayout:
    """How many ways each dimension is split; ``size`` is the number of ranks it needs."""

    sample: int
    channel: int = 1
    filter: int = 1
    depth: int = 1
    height: int = 1
    width: int = 1

    @property
    def spatial(self) -> tuple[int, int, int]:
        return (self.depth, self.height, self.width)

    @property
    def size(self) -> int:
        return self.sample * self.channel * self.filter * math.prod(self.spatial)

    def describe(self) -> str:
        """Compact strategy name such as ``N2D2H2`` (``N1`` for one rank)."""
        parts = [("N", self.sample), ("C", self.channel), ("F", self.filter),
                 ("D", self.depth), ("H", self.height), ("W", self.width)]
        name = "".join(f"{tag}{ways}" for tag, ways in parts if ways > 1)
        return name or "N1"


def resolve_parallel(cfg: Config, world_size: int, min_block: int = 1) -> ParallelLayout:
    """Check the ``parallel`` section against ``world_size`` and return the resolved layout.

    ``min_block`` is the smallest spatial block a rank may hold at the input (the halo
    width of the first layer): a split that leaves less is rejected.
    """
    par = cfg.parallel
    others = par.channel * par.filter * par.depth * par.height * par.width
    sample = _resolve_sample(par.sample, others, world_size)
    layout = ParallelLayout(sample, par.channel, par.filter, par.depth, par.height, par.width)
    if layout.size != world_size:
        raise ConfigError("parallel", f"the groups multiply to {layout.size} "
                          f"({layout.describe()}) but the job has {world_size} rank(s)",
                          f"make the product equal {world_size} or set parallel.sample: auto")
    _check_batch(cfg.train.batch_size, sample)
    for key, ways in zip(SPATIAL_KEYS, layout.spatial):
        _check_spatial(key, ways, cfg.model.width, min_block)
    return layout


def sample_groups(cfg: Config, world_size: int) -> int:
    """How many sample groups ``cfg.parallel`` makes of ``world_size`` ranks."""
    par = cfg.parallel
    others = par.channel * par.filter * par.depth * par.height * par.width
    return _resolve_sample(par.sample, others, world_size)


def _resolve_sample(sample: int | str, others: int, world_size: int) -> int:
    if sample != AUTO:
        return int(sample)
    if world_size % others != 0:
        raise ConfigError("parallel.sample", f"auto cannot fill {world_size} rank(s): the other "
                          f"groups (channel x filter x depth x height x width = {others}) "
                          f"do not divide it", f"run on a multiple of {others} ranks")
    return world_size // others


def _check_batch(batch_size: int, sample: int) -> None:
    if batch_size % sample != 0:
        raise ConfigError("train.batch_size", f"{batch_size} does not divide over "
                          f"{sample} sample group(s)", f"use a multiple of {sample}")


def _check_spatial(key: str, ways: int, width: int, min_block: int) -> None:
    smallest = width // ways
    if smallest < min_block:
        raise ConfigError(f"parallel.{key}", f"splitting model.width={width} {ways} ways leaves "
                          f"blocks of {smallest} plane(s), smaller than the halo of "
                          f"{min_block}", f"use at most {width // min_block} ways")
