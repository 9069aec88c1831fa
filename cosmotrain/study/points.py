"""The points of a scale study: which strategy each rank count measures, at which batch.

``--strategies`` lists strategy names (``N4``, ``D2H2``, ``C2F2:w``: measured at the rank
count equal to their size) and templates that stand for one strategy per rank count P
(:data:`TEMPLATES`).  Pure: no files, no MPI, so the selection is tested directly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cosmotrain.config.layout import Layout
from cosmotrain.errors import UserError

TEMPLATES = ("data", "sample", "spatial", "depth", "height", "width", "plan")
"""Strategy names that stand for a strategy per rank count P: ``data``/``sample`` = N{P};
``spatial`` = P split over depth, then height, then width; ``depth``/``height``/``width`` =
D{P}/H{P}/W{P}; ``plan`` = the planner's fastest strategy for P (needs a machine model)."""


@dataclass
class Point:
    """One measurement: ``ranks`` running ``strategy`` on a global batch of ``batch``.

    ``origin`` lists the ``--strategies`` items that asked for it (``data``, ``plan``, an
    explicit name); ``status`` is pending, ok, skipped (cannot run: ``reason``) or failed
    (the run broke: ``exit_code``, ``stderr_tail``).
    """

    ranks: int
    strategy: str
    batch: int
    origin: list[str]
    status: str = "pending"
    reason: str = ""
    exit_code: int | None = None
    stderr_tail: str = ""
    command: list[str] = field(default_factory=list)
    output_dir: str = ""
    measured: dict[str, Any] | None = None
    predicted: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        """A directory name: ``p4-D2H2``, ``p4-C2F2-w`` (no ``:`` or ``@``)."""
        return f"p{self.ranks}-" + re.sub(r"[^\w.]+", "-", self.strategy)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": self.ranks, "strategy": self.strategy,
                "batch": self.batch, "origin": list(self.origin), "status": self.status,
                "reason": self.reason, "exit_code": self.exit_code,
                "stderr_tail": self.stderr_tail, "command": list(self.command),
                "output_dir": self.output_dir, "measured": self.measured,
                "predicted": self.predicted}


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` or ``"1 2 4 8"`` -> (1, 2, 4, 8): whole numbers >= 1, sorted, unique."""
    items = [item for item in re.split(r"[,\s]+", text.strip()) if item]
    if not items or not all(re.fullmatch(r"\d+", item) and int(item) >= 1 for item in items):
        raise UserError(f"--ranks {text!r}: expected rank counts >= 1 separated by commas, "
                        f"e.g. --ranks 1,2,4,8")
    return tuple(sorted({int(item) for item in items}))


def parse_strategy_names(text: str) -> tuple[str, ...]:
    """``"N4,D2H2,plan"`` -> the names, each checked (a template or a strategy name)."""
    names = tuple(item for item in re.split(r"[,\s]+", text.strip()) if item)
    if not names:
        raise UserError(f"--strategies {text!r} is empty; e.g. --strategies data,spatial or "
                        f"--strategies N4,D2H2,C2F2:w")
    for name in names:
        if name not in TEMPLATES:
            Layout.parse(name)  # raises a UserError naming the bad strategy
    return names


def spatial_strategy(ranks: int) -> Layout:
    """P ranks over space: prime factors, largest first, dealt to depth, height, width."""
    ways, left, factor, primes = [1, 1, 1], ranks, 2, []
    while left > 1:
        while left % factor == 0:
            primes.append(factor)
            left //= factor
        factor += 1
    for i, prime in enumerate(sorted(primes, reverse=True)):
        ways[i % 3] *= prime
    return Layout(depth=ways[0], height=ways[1], width=ways[2])


def default_strategies(machine: object | None) -> tuple[str, ...]:
    """Data parallel and spatial per P, and the planner's choice when a machine loads."""
    return ("data", "spatial", "plan") if machine is not None else ("data", "spatial")


def point_batch(base_batch: int, ranks: int, mode: str) -> int:
    """Strong scaling keeps the global batch; weak scaling keeps the batch per rank."""
    return base_batch if mode == "strong" else base_batch * ranks


def check_explicit(names: Sequence[str], ranks: Sequence[int]) -> None:
    """Every explicit strategy must fit one of the rank counts (a typo otherwise)."""
    for name in names:
        if name not in TEMPLATES and Layout.parse(name).size not in ranks:
            raise UserError(f"--strategies: {name} needs {Layout.parse(name).size} "
                            f"rank(s), which is not in --ranks {','.join(map(str, ranks))}; "
                            f"add the rank count or drop the strategy")


def build_points(names: Sequence[str], ranks: Sequence[int], base_batch: int, mode: str,
                 planner: Callable[[int, int], Layout] | None) -> list[Point]:
    """The points of a study, one per distinct (P, strategy), in the order asked.

    ``planner(P, batch)`` gives the planner's choice (None: no machine model).  A template
    the planner cannot fill becomes a skipped point with the reason.
    """
    points: list[Point] = []
    for count in ranks:
        batch = point_batch(base_batch, count, mode)
        for name in names:
            try:
                strategy = template_strategy(name, count, batch, planner)
            except UserError as err:
                points.append(Point(count, name, batch, [name], "skipped", str(err)))
                continue
            if strategy is None:
                continue
            _add(points, Point(count, strategy.describe(), batch, [name]))
    return points


def template_strategy(name: str, ranks: int, batch: int,
                      planner: Callable[[int, int], Layout] | None) -> Layout | None:
    """The strategy ``name`` stands for at ``ranks`` (None: an explicit name of another P)."""
    if name in ("data", "sample"):
        return Layout(sample=ranks)
    if name == "spatial":
        return spatial_strategy(ranks)
    if name in ("depth", "height", "width"):
        return Layout(**{name: ranks})
    if name == "plan":
        if planner is None:
            raise UserError("the strategy 'plan' needs a machine model (--machine)")
        return planner(ranks, batch)
    strategy = Layout.parse(name)
    return strategy if strategy.size == ranks else None


def _add(points: list[Point], point: Point) -> None:
    for other in points:
        if (other.ranks, other.strategy) == (point.ranks, point.strategy):
            other.origin.extend(o for o in point.origin if o not in other.origin)
            return
    points.append(point)
