"""``cosmotrain plan``: price every strategy that fits P ranks and rank them.

For a config (model, width, batch) and a rank count, every factorisation of the ranks over
N, C, F, D, H, W that the batch and the volume allow (:func:`enumerate_strategies`) is built
into a workload and priced on a machine model; strategies that do not fit the memory per
rank are dropped, the rest sorted by predicted step time.  ``parallel: auto`` in a config
runs the same search at start-up (``train/auto_layout.py`` reads the machine file and
gathers the ranks' verdict; this module only takes values).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cosmotrain.config.layout import MIN_BLOCK_PLANES, Layout, layers_of
from cosmotrain.config.schema import Config
from cosmotrain.errors import ConfigError, UserError
from cosmotrain.models import build_model
from cosmotrain.nn.containers import Sequential
from cosmotrain.plan.cost import Prediction, predict
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.memory import workload_memory
from cosmotrain.plan.strategy import distinct, enumerate_strategies, most_ranks
from cosmotrain.plan.workload import build_workload

@dataclass
class Planned:
    """A priced strategy: the prediction and its memory per rank."""

    prediction: Prediction
    memory_bytes: float
    stop: str = ""  # the first layer on whole samples

    @property
    def strategy(self) -> Layout:
        return self.prediction.strategy


def price(cfg: Config, strategy: Layout, machine: MachineModel,
          ranks_per_node: int | None = None, model=None) -> Planned:
    """Predicted step and memory of ``cfg`` under ``strategy``."""
    work = build_workload(cfg, strategy, model)
    prediction = predict(work, machine, ranks_per_node)
    memory = workload_memory(work)
    prediction.memory_bytes = memory
    return Planned(prediction, memory, work.stop)


REFUSED = (ConfigError, ValueError)  # what the engine raises for a split it cannot run


def candidates(cfg: Config, ranks: int, algorithms: tuple[str, ...] = ("x", "y", "w")
               ) -> tuple[Sequential, list[Layout]]:
    """The serial model and the distinct strategies the planner considers for ``ranks``
    (channel/filter groups no wider than the model's narrowest convolution)."""
    model = build_model(cfg.model, cfg.train.seed)
    narrowest = min(layer.out_channels for _, layer in model.named_layers()
                    if hasattr(layer, "out_channels"))
    limit = most_ranks(cfg.train.batch_size, cfg.model.width, narrowest)
    if ranks > limit:
        raise UserError(f"no strategy for {ranks} rank(s): at most {limit} can share a batch "
                        f"of {cfg.train.batch_size} cubes of width {cfg.model.width} (a "
                        f"sample group per cube, {narrowest} channel/filter ranks, spatial "
                        f"blocks of {MIN_BLOCK_PLANES} planes or more); use fewer ranks or "
                        f"a larger train.batch_size")
    return model, distinct(list(enumerate_strategies(
        ranks, cfg.train.batch_size, cfg.model.width, narrowest, algorithms)))


MEMORY_RESERVE = 0.1  # the share of a node's memory left to the runtime, MPI, workspaces


@dataclass(frozen=True)
class NodeLayout:
    """How a plan places its ranks: ``nodes`` x ``per_node`` (the last node may hold fewer),
    and why that many per node."""

    ranks: int
    per_node: int
    why: str

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.per_node)

    def describe(self) -> str:
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.per_node} "
                f"rank{'s' if self.per_node > 1 else ''} per node")


def node_layout(ranks: int, given: int | None = None, allocation: int | None = None,
                machine: MachineModel | None = None) -> NodeLayout:
    """The ranks per node to plan with: ``given`` (``--ranks-per-node``); one rank per GPU
    on a GPU ``machine`` model; the Slurm ``allocation``'s tasks per node; else every rank
    on this one node, which is what ``mpiexec -n P`` does here.  Not the machine's cores:
    planning 4 ranks of a 2-core machine as 2 nodes x 2 priced N4 at 279 ms, and the 4
    ranks that mpiexec put on that one machine took 611 ms."""
    if given:
        return NodeLayout(ranks, min(ranks, given), "--ranks-per-node")
    if machine is not None and machine.memory_per_device_gib > 0:
        return NodeLayout(ranks, min(ranks, machine.cores_per_node),
                          f"one rank per GPU, {machine.cores_per_node} per node")
    if allocation:
        return NodeLayout(ranks, min(ranks, allocation), "the Slurm allocation's tasks per node")
    return NodeLayout(ranks, ranks, "all ranks on this node, as mpiexec runs them here; "
                                    "--ranks-per-node K plans for a cluster")


def default_memory_per_rank(machine: MachineModel, ranks: int,
                            ranks_per_node: int | None = None) -> float | None:
    """Bytes a rank may use, less the reserve: its device's memory (one rank per GPU),
    else its share of the node's."""
    if machine.memory_per_device_gib > 0:
        return machine.memory_per_device_gib * 2**30 * (1 - MEMORY_RESERVE)
    if machine.memory_per_node_gib <= 0:
        return None
    per_node = min(ranks, ranks_per_node or machine.cores_per_node)
    return machine.memory_per_node_gib * 2**30 * (1 - MEMORY_RESERVE) / per_node


def plan(cfg: Config, ranks: int, machine: MachineModel, ranks_per_node: int | None = None,
         memory_per_rank: float | None = None, algorithms: tuple[str, ...] = ("x", "y", "w")
         ) -> list[Planned]:
    """Every feasible strategy for ``ranks``, fastest first.

    ``memory_per_rank`` (bytes) defaults to the machine's memory per node shared by its
    ranks, less a tenth for the runtime (None: no limit when the machine says nothing).
    """
    if memory_per_rank is None:
        memory_per_rank = default_memory_per_rank(machine, ranks, ranks_per_node)
    model, strategies = candidates(cfg, ranks, algorithms)
    planned = []
    for strategy in strategies:
        try:
            item = price(cfg, strategy, machine, ranks_per_node, model)
        except REFUSED:
            continue  # a split the engine refuses (e.g. a halo wider than a block)
        if memory_per_rank is None or item.memory_bytes <= memory_per_rank:
            planned.append(item)
    if not planned:
        raise UserError(f"no strategy for {ranks} rank(s) fits: the batch of "
                        f"{cfg.train.batch_size} and width {cfg.model.width} allow none"
                        + (f" within {memory_per_rank / 2**30:.1f} GiB per rank"
                           if memory_per_rank else "")
                        + "; change the rank count, the batch or --memory-per-rank")
    return sorted(planned, key=lambda p: p.prediction.step_s)


def auto_config(cfg: Config, strategy: Layout) -> Config:
    """``cfg`` running ``strategy``: ``parallel.auto`` cleared (so the saved config and
    checkpoints record the layout that ran) and the user's per-layer overrides kept."""
    layout = replace(strategy, layers=layers_of(cfg.parallel))  # the user's, not planned
    return replace(cfg, parallel=replace(layout.to_config(cfg.parallel), auto=False))


def auto_line(strategy: Layout, ranks: int, per_node: int, step_s: float,
              machine: str) -> str:
    """The line a run prints about what ``parallel: auto`` chose, and on what model."""
    return (f"parallel: auto chose {strategy.describe()} for {ranks} rank(s) "
            f"({NodeLayout(ranks, min(per_node, ranks), '').describe()}; predicted "
            f"{step_s * 1e3:.1f} ms per step; machine model: {machine})")
