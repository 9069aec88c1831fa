"""The machine constants the cost model uses, saved as JSON by ``cosmotrain calibrate``.

Compute is priced per layer from ``layers[k][key]``: a :class:`Curve` of the seconds of
the layer's forward + backward against its output elements, measured with ``k`` ranks on
the node running it at once, each with the threads the trainer gives it, for every *layer
key* (the kind and the channel counts the kernel sees, e.g. ``Conv3d:16x32:k3s1:dx``).
Measuring per ``k`` matters: a lone rank's threads speed a thin convolution up less than
a thick one, and ranks that share a node slow memory-bound layers (pooling, activations,
thin convolutions) more than compute-bound ones, so no single factor fits every layer
(one factor from the first two convolutions over-priced data-parallel steps by 30-40%).

Beside the curves, ``shapes[k]`` keeps the seconds of every exact local shape the
calibration ran (``Conv3d:16x32:k3s1:dx@8x16x64x64x16``): a layer of the calibrated config
is priced from its own measurement, since the curve only knows output elements and the
same elements can cost more in another layout (a block 16 voxels wide along W ran
``conv2`` 1.6x slower than a 64-wide one with the same elements).

A key or ``k`` the calibration never saw falls back to the nearest measured ``k`` scaled
by ``concurrency`` (the node's slowdown with ``k`` ranks, relative to one), then to the
kind's rate in FLOP/s (convolutions, linear layers) or seconds per element (the rest),
which are one-rank rates.  ``concurrency(k)`` is below ``k`` while idle cores absorb new
ranks and about ``k / cores`` once the node is oversubscribed.  Messages cost
``alpha + beta * bytes`` per call, fitted per collective and communicator size
(point-to-point for halos), within a node and between nodes.  ``overlap`` is the share of
halo and gradient-allreduce time hidden behind computation (0 where the MPI library only
progresses messages inside MPI calls, as MPICH does by default).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cosmotrain.files.atomic import write_text_atomically
from cosmotrain.errors import DataError

FORMAT = "cosmotrain-machine-2"  # 2: per-k layer curves (1 had one-thread fits)
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bn_allreduce")


@dataclass
class Fit:
    """``seconds = a + b * x``."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


@dataclass
class Curve:
    """Seconds against elements through measured points, piecewise linear between them.

    Below the smallest point it follows the line through the two smallest (whose intercept
    is the per-call cost a small kernel call still pays), never below zero; above the
    largest it keeps the largest point's seconds per element."""

    points: list[tuple[float, float]]

    def __post_init__(self) -> None:
        self.points = sorted((float(x), float(t)) for x, t in self.points)
        if not self.points:
            raise ValueError("a curve needs at least one measured point")

    def __call__(self, x: float) -> float:
        pts = self.points
        if x >= pts[-1][0]:
            return pts[-1][1] * x / pts[-1][0] if pts[-1][0] else pts[-1][1]
        if len(pts) == 1:
            return pts[0][1] * x / pts[0][0]
        upper = next(i for i, (px, _) in enumerate(pts) if px > x)
        (x0, t0), (x1, t1) = pts[max(upper - 1, 0)], pts[max(upper, 1)]
        return max(t0 + (t1 - t0) * (x - x0) / (x1 - x0), 0.0)


@dataclass
class LinkModel:
    """alpha-beta costs: point-to-point, and per collective per communicator size.

    ``collectives`` were measured with every group of the node busy at once (segmented
    collectives); ``alone`` with one group alone on the node, which is what a job of that
    many ranks per node sees (on the 2-core development machine a pair's reduce-scatter
    costs 0.56 ns/byte alone and 1.25 beside a second pair: docs/perf/dev-2core.json)."""

    p2p: Fit
    collectives: dict[str, dict[int, Fit]] = field(default_factory=dict)
    alone: dict[str, dict[int, Fit]] = field(default_factory=dict)

    def collective(self, kind: str, group: int, nbytes: float, calls: int,
                   ranks_on_node: int = 0) -> float:
        """Seconds for ``calls`` collectives moving ``nbytes`` in all on ``group`` ranks,
        with ``ranks_on_node`` ranks busy on the node (0: as many as were calibrated)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        table = self.alone if 0 < ranks_on_node <= group and self.alone else self.collectives
        name = "allreduce" if kind == "bn_allreduce" else kind
        fits = table.get(name) or self.collectives.get(name) or \
            self.collectives.get("allreduce", {})
        if not fits:
            return calls * self.p2p.a * math.log2(group) + self.p2p.b * nbytes
        size = min(fits, key=lambda g: (abs(math.log2(g) - math.log2(group)), g))
        fit = fits[size]
        steps = max(math.log2(group) / math.log2(size), 1.0) if size > 1 else 1.0
        return calls * fit.a * steps + fit.b * nbytes


@dataclass
class MachineModel:
    """Everything the cost model knows about a machine (see the module docstring)."""

    name: str
    cores_per_node: int
    layers: dict[int, dict[str, Curve]] = field(default_factory=dict)  # k -> key -> curve
    shapes: dict[int, dict[str, float]] = field(default_factory=dict)  # k -> key@shape -> s
    flop_rate: dict[str, float] = field(default_factory=dict)  # kind -> FLOP/s, 1 thread
    element_time: dict[str, float] = field(default_factory=dict)  # kind -> s per element
    concurrency: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    intra: LinkModel = field(default_factory=lambda: LinkModel(Fit(2e-6, 1 / 5e9)))
    inter: LinkModel = field(default_factory=lambda: LinkModel(Fit(5e-6, 1 / 10e9)))
    overlap: float = 0.0
    memory_per_node_gib: float = 0.0
    memory_per_device_gib: float = 0.0  # GPUs: a rank never has more than its device's
    notes: str = ""
    source: str = "calibrated"  # calibrated | preset | estimate (what its numbers rest on)

    def slowdown(self, ranks_on_node: int) -> float:
        """``concurrency(k)``, interpolated in ``k``; past the last measurement the node's idle
        cores absorb new ranks, then each rank slows in proportion."""
        known = sorted(self.concurrency)
        k = max(1, ranks_on_node)
        if k in self.concurrency:
            return self.concurrency[k]
        below = max((n for n in known if n < k), default=known[0])
        above = min((n for n in known if n > k), default=None)
        if above is None:  # beyond: free cores first, then no more throughput
            return self.concurrency[below] * max(k / max(below, self.cores_per_node), 1.0)
        t = (k - below) / (above - below)
        return self.concurrency[below] * (1 - t) + self.concurrency[above] * t

    def layer_time(self, key: str, elements: float, ranks_on_node: int,
                   shape: str | None = None) -> float | None:
        """Measured seconds of ``key`` at ``elements`` with ``ranks_on_node`` ranks busy: the
        exact ``shape`` (``key@NxCxDxHxW``) if that level ran it, else that level's curve or
        the nearest level's scaled by ``concurrency``; None when the key was never measured."""
        k = max(1, ranks_on_node)
        if shape is not None and shape in self.shapes.get(k, {}):
            return self.shapes[k][shape]
        levels = sorted(level for level, keys in self.layers.items() if key in keys)
        if not levels:
            return None
        level = max((n for n in levels if n <= k), default=levels[0])
        seconds = self.layers[level][key](elements)
        return seconds if level == k else seconds * self.slowdown(k) / self.slowdown(level)

    def describe(self) -> str:
        """What the numbers rest on, for the line a command prints before it uses them."""
        if self.source == "estimate":
            return (f"{self.name} (a quick probe, not a calibration; run `cosmotrain "
                    f"calibrate` for a measured one)")
        if self.source == "preset":
            return f"preset {self.name} (public specifications, not a measurement)"
        return f"{self.name}, calibrated by `cosmotrain calibrate`"

    def link(self, ranks_on_node: int, group: int) -> LinkModel:
        """Intra-node costs when the communicator fits on one node."""
        return self.intra if group <= ranks_on_node else self.inter

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["layers"] = {str(k): {key: [list(p) for p in curve.points]
                                   for key, curve in sorted(keys.items())}
                          for k, keys in sorted(self.layers.items())}
        data["shapes"] = {str(k): dict(sorted(shapes.items()))
                          for k, shapes in sorted(self.shapes.items())}
        data["format"] = FORMAT
        return data

    def save(self, path: str | Path, where: str = "--out") -> Path:
        """Write the model as JSON, atomically (a job reading it meanwhile, e.g. for
        ``parallel: auto``, sees the old file or the new one, never a part)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomically(path, json.dumps(self.to_json(), indent=1,
                                                      sort_keys=True), where, unique=True)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineModel:
        return cls(
            name=str(data["name"]), cores_per_node=int(data["cores_per_node"]),
            layers={int(k): {key: Curve([tuple(p) for p in points])
                             for key, points in keys.items()}
                    for k, keys in data.get("layers", {}).items()},
            shapes={int(k): {key: float(t) for key, t in shapes.items()}
                    for k, shapes in data.get("shapes", {}).items()},
            flop_rate={k: float(v) for k, v in data.get("flop_rate", {}).items()},
            element_time={k: float(v) for k, v in data.get("element_time", {}).items()},
            concurrency={int(k): float(v) for k, v in data.get("concurrency", {1: 1}).items()},
            intra=_link(data["intra"]), inter=_link(data["inter"]),
            overlap=float(data.get("overlap", 0.0)),
            memory_per_node_gib=float(data.get("memory_per_node_gib", 0.0)),
            memory_per_device_gib=float(data.get("memory_per_device_gib", 0.0)),
            notes=str(data.get("notes", "")), source=str(data.get("source", "calibrated")))

    @classmethod
    def load(cls, path: str | Path) -> MachineModel:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            if data.get("format") == "cosmotrain-machine":
                raise ValueError("written by an older cosmotrain (one-thread layer fits)")
            if data.get("format") != FORMAT:
                raise ValueError("not a cosmotrain machine file")
            return cls.from_json(data)
        except FileNotFoundError:
            raise DataError(path, "not found", "run cosmotrain calibrate (or pass --machine "
                            "with a preset name)", kind="machine file")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(path, f"unreadable ({err})", "re-run cosmotrain calibrate to "
                            "rewrite it", kind="machine file") from None


def _link(data: dict[str, Any]) -> LinkModel:
    return LinkModel(Fit(**data["p2p"]),
                     {kind: {int(g): Fit(**fit) for g, fit in sizes.items()}
                      for kind, sizes in data.get("collectives", {}).items()},
                     {kind: {int(g): Fit(**fit) for g, fit in sizes.items()}
                      for kind, sizes in data.get("alone", {}).items()})
