"""Model-only projection of Oyama et al.'s CosmoFlow experiments on GPU-cluster presets.

    python benchmarks/projection.py                          # Markdown on stdout
    python benchmarks/projection.py --out docs/PROJECTION.md  # refresh the generated part

No training and no MPI: every figure is :mod:`cosmotrain.plan`'s prediction for the
``v100-abci``, ``a100`` and ``h100`` presets (:mod:`cosmotrain.plan.presets`), 4 GPUs (one
rank each) per node, the default ``cosmoflow`` network (no batch norm, no dropout, Adam),
set beside the published figures of REFERENCE.md:

- weak scaling at 128^3 (one sample per GPU) and 256^3 (one sample per node, split 4
  ways), 1 to 128 nodes: the planner's best strategy within the GPU's memory (less the
  planner's 10% reserve) and the paper-like fixed one (``N4n`` / ``NnD2H2``), speed-up
  over 1 node and efficiency;
- strong scaling at 512^3, mini-batch 1, 1 to 16 GPUs: the best strategy that fits
  (points that fit nowhere are marked with their smallest memory), speed-up over the
  smallest feasible point and over one node (the paper's 2.28x at 16 GPUs);
- the headline: 512 GPUs, mini-batch 128, 512^3: aggregate FLOP/s (3 x forward FLOPs per
  sample x samples/s) against 1.42 PFLOP/s, and the speed-up over one node against 111x;
- a sensitivity table: the V100 preset's assumptions changed one at a time (ring
  instead of tree latency, the per-GPU share of the node's network, the paper's own
  compute rate, every halo at network cost, no overlap) and what each moves.

With ``--out FILE`` the report replaces the text between the ``projection:begin`` and
``projection:end`` markers of FILE (the hand-written explanation around them stays), or
becomes the whole file when FILE has no markers.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from cosmotrain.config import Layout, load_config
from cosmotrain.config.schema import Config
from cosmotrain.models import build_model
from cosmotrain.plan.cost import predict
from cosmotrain.plan.flops import training_flops
from cosmotrain.plan.machine import Fit, LinkModel, MachineModel
from cosmotrain.plan.memory import workload_memory
from cosmotrain.plan.planner import REFUSED, Planned, candidates, default_memory_per_rank
from cosmotrain.plan.workload import build_workload
from cosmotrain.train.auto_layout import load_machine

GiB = 2.0 ** 30
GPUS_PER_NODE = 4
PRESETS = ("v100-abci", "a100", "h100")
NODES = tuple(2 ** i for i in range(8))  # 1 .. 128
STRONG_GPUS = (1, 2, 4, 8, 16)
BEGIN, END = "<!-- projection:begin -->", "<!-- projection:end -->"

# REFERENCE.md, "Published performance" and "CosmoFlow networks" (Oyama et al., ABCI V100).
PUBLISHED = {
    "weak_nodes": 128, "weak_speedup": {128: 119.0, 256: 120.0},
    "strong_gpus": 16, "strong_speedup": 2.28,  # over one node (4 GPUs), I/O limited
    "headline_gpus": 512, "headline_batch": 128, "headline_width": 512,
    "headline_pflops": 1.42, "headline_speedup": 111.0,
    "sample_gib": {128: 0.824, 256: 6.59, 512: 52.7},  # activations per sample
}


# --------------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class Target:
    """A machine to price on and the memory one rank (GPU) may use (bytes)."""

    name: str
    machine: MachineModel
    memory_bytes: float


def gpu_memory_limit(machine: MachineModel) -> float:
    """Bytes one GPU (rank) may use: the planner's default for a full node, i.e. the
    preset's memory per GPU less the planner's reserve, at *every* rank count.

    ``planner.plan``'s own default divides the node's memory by the ranks actually on
    it, which suits CPU nodes (shared memory) but hands a lone GPU rank the memory of
    all 4 GPUs; a GPU's memory is its own, so the projection fixes the per-GPU figure.
    """
    limit = default_memory_per_rank(machine, machine.cores_per_node)
    if limit is None:
        raise ValueError(f"machine {machine.name} has no memory per node")
    return limit


def targets(names: Iterable[str] = PRESETS) -> list[Target]:
    """The presets ``names`` with their memory limit per GPU (:func:`gpu_memory_limit`)."""
    machines = [load_machine(name) for name in names]
    return [Target(m.name, m, gpu_memory_limit(m)) for m in machines]


def model_config(width: int, batch: int) -> Config:
    """The default ``cosmoflow`` network at ``width`` with mini-batch ``batch``."""
    return load_config(None, ["model.name=cosmoflow", f"model.width={width}",
                              f"train.batch_size={batch}"])


@dataclass
class Point:
    """One strategy priced on one preset (``samples_per_s`` 0 when it does not fit)."""

    preset: str
    gpus: int
    batch: int
    strategy: str
    samples_per_s: float
    memory_gib: float
    feasible: bool
    comm_share: float = 0.0
    speedup: float | None = None  # filled by the experiment (None: no baseline)
    efficiency: float | None = None

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / GPUS_PER_NODE)


def _point(item: Planned, target: Target, gpus: int, batch: int) -> Point:
    fits = item.memory_bytes <= target.memory_bytes
    p = item.prediction
    return Point(target.name, gpus, batch, p.strategy.describe(),
                 p.samples_per_s if fits else 0.0, item.memory_bytes / GiB, fits,
                 p.comm_share)


def _priced(cfg: Config, strategy: Layout, machines: list[Target], model
            ) -> dict[str, Planned] | None:
    """``strategy`` priced on every target from one workload (None: the engine refuses)."""
    try:
        work = build_workload(cfg, strategy, model)
    except REFUSED:
        return None
    memory = workload_memory(work)
    priced = {}
    for target in machines:
        prediction = predict(work, target.machine, GPUS_PER_NODE)
        prediction.memory_bytes = memory
        priced[target.name] = Planned(prediction, memory, work.stop)
    return priced


def plan_targets(cfg: Config, ranks: int, machines: list[Target]) -> dict[str, list[Planned]]:
    """:func:`cosmotrain.plan.planner.plan` on several presets at once, unfiltered.

    The same candidates, workloads and ranking as the planner (fastest first), but each
    workload is built once and priced on every preset (the workload does not depend on
    the machine), and nothing is dropped for memory: the callers filter per preset.
    """
    model, strategies = candidates(cfg, ranks)
    ranked: dict[str, list[Planned]] = {t.name: [] for t in machines}
    for strategy in strategies:
        for name, item in (_priced(cfg, strategy, machines, model) or {}).items():
            ranked[name].append(item)
    return {name: sorted(items, key=lambda i: i.prediction.step_s)
            for name, items in ranked.items()}


def best_points(cfg: Config, ranks: int, machines: list[Target]) -> dict[str, Point]:
    """Per preset: the fastest strategy within its memory, else the leanest (infeasible)."""
    batch, ranked_by = cfg.train.batch_size, plan_targets(cfg, ranks, machines)
    chosen = {}
    for target in machines:
        ranked = ranked_by[target.name]
        fits = [i for i in ranked if i.memory_bytes <= target.memory_bytes]
        item = fits[0] if fits else min(ranked, key=lambda i: i.memory_bytes)
        chosen[target.name] = _point(item, target, ranks, batch)
    return chosen


def fixed_points(cfg: Config, strategy: str, machines: list[Target]) -> dict[str, Point]:
    """Per preset: ``strategy`` priced (marked infeasible where it does not fit)."""
    parsed = Layout.parse(strategy)
    model = build_model(cfg.model, cfg.train.seed)
    priced = _priced(cfg, parsed, machines, model)
    if priced is None:
        raise ValueError(f"strategy {strategy} cannot run width {cfg.model.width}")
    return {t.name: _point(priced[t.name], t, parsed.size, cfg.train.batch_size)
            for t in machines}


def _relative(points: list[Point], base: Point | None, base_units: float,
              units: Iterable[float]) -> None:
    """Speed-up over ``base`` and efficiency (speed-up / (units / base_units))."""
    for point, unit in zip(points, units):
        if base is None or not base.feasible or not point.feasible:
            continue
        point.speedup = point.samples_per_s / base.samples_per_s
        point.efficiency = point.speedup / (unit / base_units)


# --------------------------------------------------------------------------- experiments


@dataclass
class WeakRow:
    nodes: int
    batch: int
    best: Point
    fixed: Point

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE


def weak_batch(width: int, nodes: int) -> int:
    """One sample per GPU at 128^3, one sample per node (split 4 ways) above."""
    return nodes * GPUS_PER_NODE if width <= 128 else nodes


def weak_fixed(width: int, nodes: int) -> str:
    """The paper-like strategy: data parallel at 128^3, NnD2H2 above."""
    return f"N{nodes * GPUS_PER_NODE}" if width <= 128 else f"N{nodes}D2H2"


def weak_scaling(width: int, machines: list[Target], nodes: Iterable[int] = NODES
                 ) -> dict[str, list[WeakRow]]:
    """Per preset, one row per node count: best and fixed strategy, speed-up over the
    first node count and efficiency (speed-up / node ratio)."""
    rows: dict[str, list[WeakRow]] = {t.name: [] for t in machines}
    for n in nodes:
        cfg = model_config(width, weak_batch(width, n))
        best = best_points(cfg, n * GPUS_PER_NODE, machines)
        fixed = fixed_points(cfg, weak_fixed(width, n), machines)
        for t in machines:
            rows[t.name].append(WeakRow(n, cfg.train.batch_size, best[t.name], fixed[t.name]))
    for series in rows.values():
        units = [r.nodes for r in series]
        for kind in ("best", "fixed"):
            points = [getattr(r, kind) for r in series]
            _relative(points, points[0], units[0], units)
    return rows


@dataclass
class StrongRow:
    gpus: int
    best: Point
    fixed: Point
    over_node: float | None = None  # best's speed-up over the best at one node (4 GPUs)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / GPUS_PER_NODE)


def strong_fixed(gpus: int) -> str:
    """Spatial splits over depth, then height, then width (the 512^3 config's D x H)."""
    return {1: "N1", 2: "D2", 4: "D2H2", 8: "D4H2", 16: "D4H4"}.get(gpus) or \
        f"D{gpus // 4}H4"


def strong_scaling(machines: list[Target], gpus: Iterable[int] = STRONG_GPUS,
                   width: int = 512, batch: int = 1) -> dict[str, list[StrongRow]]:
    """Per preset: best fitting strategy per GPU count, speed-up over the smallest
    feasible count (efficiency relative to it) and over one node."""
    cfg = model_config(width, batch)
    rows: dict[str, list[StrongRow]] = {t.name: [] for t in machines}
    for g in gpus:
        best = best_points(cfg, g, machines)
        fixed = fixed_points(cfg, strong_fixed(g), machines)
        for t in machines:
            rows[t.name].append(StrongRow(g, best[t.name], fixed[t.name]))
    for series in rows.values():
        for kind in ("best", "fixed"):
            points = [getattr(r, kind) for r in series]
            base = next((p for p in points if p.feasible), None)
            _relative(points, base, base.gpus if base else 1, [p.gpus for p in points])
        node = next((r.best for r in series if r.gpus == GPUS_PER_NODE and r.best.feasible),
                    None)
        for r in series:
            if node is not None and r.best.feasible and r.gpus >= GPUS_PER_NODE:
                r.over_node = r.best.samples_per_s / node.samples_per_s
    return rows


@dataclass
class Headline:
    preset: str
    forward_flop: float  # per sample
    best: Point
    fixed: Point
    node_best: Point
    node_fixed: Point

    def pflops(self, point: Point) -> float:
        """Aggregate PFLOP/s: forward + backward (3 x forward) FLOPs x samples/s."""
        return 3.0 * self.forward_flop * point.samples_per_s / 1e15

    def over_node(self, point: Point, node: Point) -> float | None:
        if not (point.feasible and node.feasible):
            return None
        return point.samples_per_s / node.samples_per_s


def forward_flop(width: int) -> float:
    """Forward FLOPs of one sample of the default network at ``width``."""
    cfg = model_config(width, 1)
    forward, _ = training_flops(build_model(cfg.model, cfg.train.seed),
                                (1, cfg.model.channels, width, width, width))
    return float(forward)


def headline(machines: list[Target], gpus: int = 512, batch: int = 128, width: int = 512,
             search: bool = True) -> dict[str, Headline]:
    """The 1.42 PFLOP/s run: ``gpus`` GPUs, mini-batch ``batch``, one sample per node
    (4 GPUs, D2H2) against one node with one sample; ``search``: also the planner's best."""
    per_sample = gpus // batch  # GPUs per sample
    split = {1: "", 4: "D2H2"}.get(per_sample, f"D{per_sample}")
    fixed_name, node_name = f"N{batch}{split}", split or "N1"
    big, node = model_config(width, batch), model_config(width, 1)
    fixed = fixed_points(big, fixed_name, machines)
    node_fixed = fixed_points(node, node_name, machines)
    best = best_points(big, gpus, machines) if search else fixed
    node_best = best_points(node, per_sample, machines) if search else node_fixed
    flop = forward_flop(width)
    return {t.name: Headline(t.name, flop, best[t.name], fixed[t.name], node_best[t.name],
                             node_fixed[t.name]) for t in machines}


# --------------------------------------------------------------------------- sensitivity


def ring_latency(machine: MachineModel) -> MachineModel:
    """``machine`` whose collectives pay a flat ring's latency, ``factor x (p - 1)``
    steps of ``alpha`` (allreduce: factor 2), instead of the presets' tree ``log2 p``;
    bandwidth terms and the all-to-all (already ``p - 1``) unchanged."""
    changed = copy.deepcopy(machine)
    for link in (changed.intra, changed.inter):
        for kind, sizes in link.collectives.items():
            if kind == "alltoall":
                continue
            factor = 2.0 if kind == "allreduce" else 1.0
            link.collectives[kind] = {p: Fit(factor * (p - 1) * link.p2p.a, f.b)
                                      for p, f in sizes.items()}
    return changed


def per_gpu_network(machine: MachineModel) -> MachineModel:
    """``machine`` whose traffic between nodes runs at one GPU's share of the node's
    network (node bandwidth / GPUs per node), as if each GPU's collective traffic crossed
    the node boundary on its own instead of once per node; latencies unchanged."""
    changed = copy.deepcopy(machine)
    share = float(changed.cores_per_node)
    inter = changed.inter
    changed.inter = LinkModel(
        Fit(inter.p2p.a, inter.p2p.b * share),
        {kind: {p: Fit(f.a, f.b * share) for p, f in sizes.items()}
         for kind, sizes in inter.collectives.items()})
    return changed


def conv_rate(machine: MachineModel, flop_per_s: float) -> MachineModel:
    """``machine`` with convolutions and linear layers at ``flop_per_s``."""
    changed = copy.deepcopy(machine)
    changed.flop_rate = dict.fromkeys(changed.flop_rate, flop_per_s)
    return changed


def network_halos(machine: MachineModel) -> MachineModel:
    """``machine`` whose halos all pay the network: inter-node latency and one GPU's
    share of the node's bandwidth (all of a node's GPUs exchange halos at once).  An
    upper bound for spatial groups that span nodes; the cost model prices every halo on
    the intra-node link (``MachineModel.link`` with the halo's group of 1)."""
    changed = copy.deepcopy(machine)
    p2p = changed.inter.p2p
    changed.intra = LinkModel(Fit(p2p.a, p2p.b * changed.cores_per_node),
                              changed.intra.collectives)
    return changed


def no_overlap(machine: MachineModel) -> MachineModel:
    """``machine`` that hides no halo or gradient-allreduce time behind computation."""
    return replace(copy.deepcopy(machine), overlap=0.0)


def paper_gpu_rate() -> float:
    """FLOP/s per V100 the paper's headline implies (1.42 PFLOP/s / 512 GPUs)."""
    return PUBLISHED["headline_pflops"] * 1e15 / PUBLISHED["headline_gpus"]


@dataclass
class Variant:
    name: str
    weak128: float  # efficiency at the largest node count, N(4n), 128^3
    weak256: float  # efficiency at the largest node count, NnD2H2, 256^3
    strong: float  # D4H4 (16 GPUs) over D2H2 (4 GPUs), 512^3 batch 1
    pflops: float  # N128D2H2, 512 GPUs, 512^3
    headline_speedup: float  # N128D2H2 over D2H2 (one node)


def variants(base: Target) -> list[Target]:
    """The preset as documented, then one assumption changed at a time."""
    m, rate = base.machine, paper_gpu_rate()
    share = m.cores_per_node
    network = 1 / m.inter.p2p.b / 1e9
    return [
        replace(base, name=f"{base.name} as documented"),
        replace(base, name="ring latency (p - 1 steps of alpha) instead of tree (log2 p)",
                machine=ring_latency(m)),
        replace(base, name=f"per-GPU share of the node's network between nodes "
                           f"({network / share:.0f} instead of {network:.0f} GB/s)",
                machine=per_gpu_network(m)),
        replace(base, name=f"conv/linear at the paper's own {rate / 1e12:.2f} TFLOP/s per "
                           f"GPU (1.42 PFLOP/s / 512; preset "
                           f"{m.flop_rate['Conv3d'] / 1e12:.2f})",
                machine=conv_rate(m, rate)),
        replace(base, name=f"every halo at network cost ({m.inter.p2p.a * 1e6:.0f} us, "
                           f"{network / share:.0f} GB/s per GPU)",
                machine=network_halos(m)),
        replace(base, name=f"no overlap (0% instead of {m.overlap:.0%} of halos and "
                           f"allreduce hidden)", machine=no_overlap(m)),
    ]


def sensitivity(base: Target, nodes: int = 128) -> list[Variant]:
    """Fixed (paper-like) strategies under each variant of ``base``: what moves what."""
    machines = variants(base)
    gpus = nodes * GPUS_PER_NODE

    def rate(width: int, batch: int, strategy: str) -> dict[str, float]:
        return {k: p.samples_per_s for k, p in
                fixed_points(model_config(width, batch), strategy, machines).items()}

    w128 = (rate(128, gpus, f"N{gpus}"), rate(128, GPUS_PER_NODE, f"N{GPUS_PER_NODE}"))
    w256 = (rate(256, nodes, f"N{nodes}D2H2"), rate(256, 1, "D2H2"))
    strong = (rate(512, 1, "D4H4"), rate(512, 1, "D2H2"))
    big = rate(512, nodes, f"N{nodes}D2H2")
    flop = forward_flop(512)
    return [Variant(t.name, w128[0][t.name] / w128[1][t.name] / nodes,
                    w256[0][t.name] / w256[1][t.name] / nodes,
                    strong[0][t.name] / strong[1][t.name],
                    3 * flop * big[t.name] / 1e15, big[t.name] / strong[1][t.name])
            for t in machines]


# --------------------------------------------------------------------------- report


@dataclass
class Projection:
    presets: list[str]
    weak: dict[int, dict[str, list[WeakRow]]]
    strong: dict[str, list[StrongRow]]
    headline: dict[str, Headline]
    sensitivity: list[Variant] = field(default_factory=list)
    machines: list[Target] = field(default_factory=list)
    nodes: tuple[int, ...] = NODES
    seconds: float = 0.0


def project(presets: Iterable[str] = PRESETS, nodes: Iterable[int] = NODES,
            widths: Iterable[int] = (128, 256), strong_gpus: Iterable[int] = STRONG_GPUS,
            headline_gpus: int = 512, headline_batch: int = 128, search: bool = True,
            with_sensitivity: bool = True) -> Projection:
    """Every experiment on every preset in ``presets``."""
    start = time.perf_counter()
    machines = targets(presets)
    nodes = tuple(nodes)
    weak = {w: weak_scaling(w, machines, nodes) for w in widths}
    strong = strong_scaling(machines, strong_gpus)
    top = headline(machines, headline_gpus, headline_batch, search=search)
    sens = sensitivity(machines[0], max(nodes)) if with_sensitivity and \
        machines[0].name == "v100-abci" else []
    return Projection(list(presets), weak, strong, top, sens, machines, nodes,
                      time.perf_counter() - start)


def _x(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}x"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _rate(point: Point) -> str:
    return f"{point.samples_per_s:,.1f}" if point.feasible else "does not fit"


def _strategy(point: Point) -> str:
    return f"`{point.strategy}`" + ("" if point.feasible else " (too big)")


def constants_table(machines: list[Target]) -> list[str]:
    """The numbers each preset hands the cost model (read back from the MachineModel)."""
    lines = ["| preset | conv / linear FLOP/s | memory-bound layers (GB/s, 12 B/element) | "
             "NVLink alpha, GB/s | network alpha, GB/s per node | allreduce latency, "
             "512 ranks | overlap | memory per GPU (limit) |",
             "|---|---|---|---|---|---|---|---|"]
    for t in machines:
        m = t.machine
        element = m.element_time.get("LeakyReLU", 0.0)
        gpus = m.cores_per_node
        tree = m.inter.collectives["allreduce"][512].a
        lines.append(
            f"| {t.name} | {m.flop_rate.get('Conv3d', 0) / 1e12:.2f} T | "
            f"{12.0 / element / 1e9:,.0f} | {m.intra.p2p.a * 1e6:.0f} us, "
            f"{1 / m.intra.p2p.b / 1e9:.0f} | {m.inter.p2p.a * 1e6:.0f} us, "
            f"{1 / m.inter.p2p.b / 1e9:.0f} | {tree * 1e6:.0f} us "
            f"({tree / m.inter.p2p.a:.0f} alpha) | {m.overlap:.0%} | "
            f"{m.memory_per_node_gib / gpus:.0f} GiB ({t.memory_bytes / GiB:.1f}) |")
    return lines


def weak_tables(width: int, rows: dict[str, list[WeakRow]]) -> list[str]:
    published = PUBLISHED["weak_speedup"].get(width)
    last = PUBLISHED["weak_nodes"]
    lines = [f"### Weak scaling at {width}^3 ("
             + ("one sample per GPU, data parallel" if width <= 128 else
                "one sample per node, split over the node's 4 GPUs")
             + ")", ""]
    summary = ["| preset | best: speed-up at 128 nodes | efficiency | fixed: speed-up | "
               "efficiency | published |", "|---|---|---|---|---|---|"]
    for preset, series in rows.items():
        lines += [f"**{preset}**", "",
                  "| nodes | GPUs | batch | best strategy | GiB/GPU | samples/s | speed-up | "
                  "efficiency | fixed strategy | samples/s | speed-up | efficiency | "
                  "published |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in series:
            pub = f"{published:.0f}x ({published / last:.0%})" \
                if published and r.nodes == last else "—"
            lines.append(
                f"| {r.nodes} | {r.gpus} | {r.batch} | {_strategy(r.best)} | "
                f"{r.best.memory_gib:.2f} | {_rate(r.best)} | {_x(r.best.speedup)} | "
                f"{_pct(r.best.efficiency)} | {_strategy(r.fixed)} | {_rate(r.fixed)} | "
                f"{_x(r.fixed.speedup)} | {_pct(r.fixed.efficiency)} | {pub} |")
        lines.append("")
        end = series[-1]
        pub = f"{published:.0f}x ({published / last:.0%})" \
            if published and end.nodes == last else "—"
        summary.append(f"| {preset} | {_x(end.best.speedup)} | {_pct(end.best.efficiency)} | "
                       f"{_x(end.fixed.speedup)} | {_pct(end.fixed.efficiency)} | {pub} |")
    nodes = rows[next(iter(rows))][-1].nodes
    return lines + [f"Summary at {nodes} nodes:", ""] + summary + [""]


def strong_tables(rows: dict[str, list[StrongRow]]) -> list[str]:
    paper_gib = PUBLISHED["sample_gib"][512]
    lines = ["### Strong scaling at 512^3, mini-batch 1", ""]
    for preset, series in rows.items():
        lines += [f"**{preset}**", "",
                  "| GPUs | nodes | best strategy | GiB/GPU (model) | GiB/GPU (paper: 52.7 / GPUs) "
                  "| samples/s | speed-up over smallest feasible | over 1 node | "
                  "fixed strategy | samples/s | published |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in series:
            pub = f"{PUBLISHED['strong_speedup']}x over 1 node (I/O limited)" \
                if r.gpus == PUBLISHED["strong_gpus"] else "—"
            lines.append(
                f"| {r.gpus} | {r.nodes} | {_strategy(r.best)} | {r.best.memory_gib:.2f} | "
                f"{paper_gib / r.gpus:.1f} | {_rate(r.best)} | {_x(r.best.speedup, 2)} | "
                f"{_x(r.over_node, 2)} | {_strategy(r.fixed)} | {_rate(r.fixed)} | {pub} |")
        implied = implied_io(series)
        if implied is not None:
            lines += ["", f"A fixed, non-overlapped {implied * 1e3:.0f} ms per sample "
                          f"(e.g. reading 1 GiB at {1 / implied:.1f} GiB/s) added to every "
                          f"point would bring this preset's 16-GPU speed-up over one node "
                          f"down to the published {PUBLISHED['strong_speedup']}x."]
        lines.append("")
    return lines


def implied_io(series: list[StrongRow]) -> float | None:
    """Seconds per sample that, added to every step, turn the 16-over-4-GPU speed-up into
    the published one: (t4 + x) / (t16 + x) = s."""
    s = PUBLISHED["strong_speedup"]
    by_gpus = {r.gpus: r.best for r in series if r.best.feasible}
    if GPUS_PER_NODE not in by_gpus or PUBLISHED["strong_gpus"] not in by_gpus:
        return None
    t4 = 1 / by_gpus[GPUS_PER_NODE].samples_per_s
    t16 = 1 / by_gpus[PUBLISHED["strong_gpus"]].samples_per_s
    x = (t4 - s * t16) / (s - 1)
    return x if x > 0 else None


def headline_table(heads: dict[str, Headline]) -> list[str]:
    lines = ["### Headline: 512 GPUs, mini-batch 128, 512^3", "",
             "| preset | strategy | samples/s | PFLOP/s | TFLOP/s per GPU | "
             "speed-up over 1 node (1 sample) | published |",
             "|---|---|---|---|---|---|---|"]
    gpus = PUBLISHED["headline_gpus"]
    for preset, h in heads.items():
        for label, point, node in (("best", h.best, h.node_best),
                                   ("fixed", h.fixed, h.node_fixed)):
            pub = f"{PUBLISHED['headline_pflops']} PFLOP/s, " \
                  f"{PUBLISHED['headline_speedup']:.0f}x" if preset == "v100-abci" else "—"
            pflops = h.pflops(point) if point.feasible else None
            lines.append(
                f"| {preset} | {label} {_strategy(point)} (1 node: `{node.strategy}`) | "
                f"{_rate(point)} | {'—' if pflops is None else f'{pflops:.2f}'} | "
                f"{'—' if pflops is None else f'{pflops * 1e3 / point.gpus:.2f}'} | "
                f"{_x(h.over_node(point, node), 0)} | {pub} |")
    flop = next(iter(heads.values())).forward_flop
    pub_rate = PUBLISHED["headline_pflops"] * 1e15 / (3 * flop)
    lines += ["", f"Forward FLOPs per 512^3 sample: {flop / 1e12:.3f} T (x3 = "
                  f"{3 * flop / 1e12:.2f} T forward + backward).  The published 1.42 PFLOP/s "
                  f"is {pub_rate:.0f} samples/s, {paper_gpu_rate() / 1e12:.2f} TFLOP/s per "
                  f"V100 ({paper_gpu_rate() / 15.7e12:.0%} of its 15.7 TFLOP/s fp32 peak), "
                  f"on {gpus} GPUs.", ""]
    return lines


def sensitivity_table(rows: list[Variant], nodes: int) -> list[str]:
    if not rows:
        return []
    lines = ["### Sensitivity (v100-abci, paper-like fixed strategies, one change at a time)",
             "",
             f"| variant | weak 128^3 efficiency at {nodes} nodes (`N{4 * nodes}`) | "
             f"weak 256^3 (`N{nodes}D2H2`) | strong 16 over 4 GPUs (`D4H4` / `D2H2`) | "
             f"headline PFLOP/s (`N{nodes}D2H2`, 512^3) | headline over 1 node |",
             "|---|---|---|---|---|---|"]
    for v in rows:
        lines.append(f"| {v.name} | {v.weak128:.0%} | {v.weak256:.0%} | {v.strong:.2f}x | "
                     f"{v.pflops:.2f} | {v.headline_speedup:.0f}x |")
    lines.append("| published | 93% (119x) | 94% (120x) | 2.28x (I/O limited) | 1.42 | 111x |")
    return lines + [""]


def render(result: Projection) -> str:
    """The generated part of docs/PROJECTION.md (Markdown)."""
    lines = [f"Generated by `python benchmarks/projection.py` "
             f"({', '.join(result.presets)}; {GPUS_PER_NODE} GPUs (ranks) per node; "
             f"model only).", "",
             "### Preset constants", ""]
    lines += constants_table(result.machines) + [""]
    for width, rows in result.weak.items():
        lines += weak_tables(width, rows)
    lines += strong_tables(result.strong)
    lines += headline_table(result.headline)
    lines += sensitivity_table(result.sensitivity, max(result.nodes))
    return "\n".join(lines).rstrip() + "\n"


def write_report(text: str, path: Path) -> Path:
    """Replace the text between the markers of ``path``, or write the whole file."""
    old = path.read_text() if path.is_file() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = f"{head}{BEGIN}\n{text}{END}{tail}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    parser.add_argument("--max-nodes", type=int, default=128,
                        help="weak scaling from 1 node up to this (powers of two)")
    parser.add_argument("--no-search", action="store_true",
                        help="headline: price the fixed strategy only (faster)")
    parser.add_argument("--out", type=Path, help="write the report here (see the docstring)")
    args = parser.parse_args(argv)
    nodes = tuple(n for n in NODES if n <= args.max_nodes)
    result = project(args.presets, nodes, search=not args.no_search)
    text = render(result)
    if args.out:
        write_report(text, args.out)
        print(f"wrote {args.out} ({result.seconds:.0f} s)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
