"""The machine constants the cost model uses, saved as JSON by ``cosmotrain calibrate``.

Compute is priced per layer: ``seconds = a + b * elements`` for the layer's forward +
backward on one thread with the node otherwise idle, fitted per *layer key* (the kind and
the channel counts the kernel sees, e.g. ``Conv3d:16x32:k3s1``; ``elements`` is the
output's).  A key the calibration never saw falls back to the kind's rate in FLOP/s
(convolutions, linear layers) or seconds per element (the rest).

Running ``k`` ranks at once on a node costs each of them ``concurrency(k)`` times its
one-thread time: below 1 when a lone rank's threads speed it up, about ``k / cores`` once
the node is oversubscribed, above that when memory bandwidth is shared.  Messages cost
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

from cosmotrain.errors import DataError

FORMAT = "cosmotrain-machine"
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bn_allreduce")


@dataclass
class Fit:
    """``seconds = a + b * x``."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


@dataclass
class LinkModel:
    """alpha-beta costs: point-to-point, and per collective per communicator size."""

    p2p: Fit
    collectives: dict[str, dict[int, Fit]] = field(default_factory=dict)

    def collective(self, kind: str, group: int, nbytes: float, calls: int) -> float:
        """Seconds for ``calls`` collectives moving ``nbytes`` in all on ``group`` ranks."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        fits = self.collectives.get("allreduce" if kind == "bn_allreduce" else kind) or \
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
    layers: dict[str, Fit] = field(default_factory=dict)
    flop_rate: dict[str, float] = field(default_factory=dict)  # kind -> FLOP/s, 1 thread
    element_time: dict[str, float] = field(default_factory=dict)  # kind -> s per element
    concurrency: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    intra: LinkModel = field(default_factory=lambda: LinkModel(Fit(2e-6, 1 / 5e9)))
    inter: LinkModel = field(default_factory=lambda: LinkModel(Fit(5e-6, 1 / 10e9)))
    overlap: float = 0.0
    memory_per_node_gib: float = 0.0
    memory_per_device_gib: float = 0.0  # GPUs: a rank never has more than its device's
    notes: str = ""

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

    def link(self, ranks_on_node: int, group: int) -> LinkModel:
        """Intra-node costs when the communicator fits on one node."""
        return self.intra if group <= ranks_on_node else self.inter

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = FORMAT
        return data

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineModel:
        return cls(
            name=str(data["name"]), cores_per_node=int(data["cores_per_node"]),
            layers={k: Fit(**v) for k, v in data.get("layers", {}).items()},
            flop_rate={k: float(v) for k, v in data.get("flop_rate", {}).items()},
            element_time={k: float(v) for k, v in data.get("element_time", {}).items()},
            concurrency={int(k): float(v) for k, v in data.get("concurrency", {1: 1}).items()},
            intra=_link(data["intra"]), inter=_link(data["inter"]),
            overlap=float(data.get("overlap", 0.0)),
            memory_per_node_gib=float(data.get("memory_per_node_gib", 0.0)),
            memory_per_device_gib=float(data.get("memory_per_device_gib", 0.0)),
            notes=str(data.get("notes", "")))

    @classmethod
    def load(cls, path: str | Path) -> MachineModel:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError("not a cosmotrain machine file")
            return cls.from_json(data)
        except FileNotFoundError:
            raise DataError(path, "machine file not found",
                            "run cosmotrain calibrate (or pass --machine with a preset name)")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(path, f"unreadable machine file ({err})",
                            "re-run cosmotrain calibrate to rewrite it") from None


def _link(data: dict[str, Any]) -> LinkModel:
    return LinkModel(Fit(**data["p2p"]),
                     {kind: {int(g): Fit(**fit) for g, fit in sizes.items()}
                      for kind, sizes in data.get("collectives", {}).items()})
