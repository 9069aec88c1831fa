"""PNG plots of a scale study (matplotlib, a dependency; Agg, no display needed).

Importing this module raises ImportError in an installation that lacks matplotlib, which
:func:`cosmotrain.study.report.render` turns into a one-line hint.  Figures are built
with ``matplotlib.figure.Figure`` on an Agg canvas, never pyplot, so no global backend
state is touched.

The report calls the plots, never the other way round: :func:`write_plots` draws the
document :func:`cosmotrain.study.report.document` made, its derived numbers (speedup,
efficiency) and its ``baseline`` (the reference point's name) included.

Lines connect the points of one *series*: a template (``data``, ``spatial``, ``plan``, ...)
or the family of an explicit name (N2, N4 -> ``N``; D2H2 -> ``DH``).  A 1-rank baseline is
every strategy at once, so it starts every series.  The legend names a family series by
its strategies as the results table does (``C2F2:w``, ``N2, N4``), never by the family key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cosmotrain.study.points import TEMPLATES
from cosmotrain.train.outputs.metrics import TIME_KEYS

PHASE_COLOURS = {"compute": "#4c72b0", "halo": "#dd8452", "channel": "#8172b3",
                 "redistribution": "#c44e52", "allreduce": "#55a868",
                 "io_wait": "#937860", "other": "#8c8c8c"}
HEADROOM = 1.12  # the breakdown's y-limit over its tallest bar


def write_plots(doc: Mapping[str, Any], out: Path) -> list[Path]:
    """Throughput, speedup (strong) or efficiency (weak), time breakdown and measured vs
    predicted, as PNGs in ``out`` (a plot with nothing to show is left out).

    ``doc``: the report's document, with the derived numbers and ``baseline``."""
    ok = [p for p in doc["points"] if p["status"] == "ok"]
    if not ok:
        return []
    base = next(p for p in ok if p["name"] == doc["baseline"])
    scaling = "speedup" if doc["mode"] == "strong" else "efficiency"
    written = [_save(throughput_figure(doc, ok, base), out / "throughput.png"),
               _save(scaling_figure(doc, ok, base, scaling), out / f"{scaling}.png"),
               _save(breakdown_figure(ok), out / "breakdown.png")]
    if any(p.get("predicted") for p in ok):
        written.append(_save(predicted_figure(ok), out / "predicted.png"))
    return written


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def series_keys(point: Mapping[str, Any]) -> list[str]:
    """The series a point belongs to: its templates, else its strategy's family."""
    keys = [o for o in point.get("origin", []) if o in TEMPLATES]
    return keys or [re.sub(r"\d+", "", point["strategy"].split("@")[0])]


def series(points: Sequence[Mapping[str, Any]], base: Mapping[str, Any]
           ) -> dict[str, list[Mapping[str, Any]]]:
    """Points by series, by rank count, each started by the baseline ``base`` if it has one
    rank."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for point in points:
        for key in series_keys(point):
            grouped.setdefault(key, []).append(point)
    for members in grouped.values():
        if base["ranks"] == 1 and all(p["ranks"] > 1 for p in members):
            members.append(base)
        members.sort(key=lambda p: (p["ranks"], p["strategy"]))
    return grouped


def series_label(key: str, members: Sequence[Mapping[str, Any]]) -> str:
    """A series' legend text: a template's name (``data``, ``spatial``, ``plan``), else the
    strategy names of its points as the results table writes them (``C2F2:w``, never the
    family key ``CF:w`` that groups them; ``N2, N4`` for a family of several)."""
    if key in TEMPLATES:
        return key
    return ", ".join(dict.fromkeys(p["strategy"] for p in members if key in series_keys(p)))


def _style(index: int) -> dict[str, Any]:
    """Series that share points (data and plan often do) stay visible: each later series
    is drawn thinner, with a smaller marker of another shape, on top of the earlier ones."""
    return {"marker": "os^Dv<>ph"[index % 9], "linewidth": max(1.0, 3.5 - 0.8 * index),
            "markersize": max(4.0, 10.0 - 1.5 * index)}


def _rank_axis(ax: Any, points: Sequence[Mapping[str, Any]]) -> None:
    ranks = sorted({p["ranks"] for p in points})
    if ranks[-1] > 2 * ranks[0]:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("ranks")
    ax.grid(True, alpha=0.3)


def _title(doc: Mapping[str, Any], what: str) -> str:
    return f"{what}: {doc['mode']} scaling, {doc['model']} W={doc['width']}"


def throughput_figure(doc: Mapping[str, Any], ok: Sequence[Mapping[str, Any]],
                      base: Mapping[str, Any]) -> Figure:
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for i, (key, members) in enumerate(series(ok, base).items()):
        ax.plot([p["ranks"] for p in members],
                [p["measured"]["samples_per_s"] for p in members],
                label=series_label(key, members), **_style(i))
    ranks = sorted({p["ranks"] for p in ok})
    ax.plot(ranks, [base["measured"]["samples_per_s"] * r / base["ranks"] for r in ranks],
            "k--", lw=1, label="ideal")
    _rank_axis(ax, ok)
    ax.set_ylabel("samples / s (measured)")
    ax.set_title(_title(doc, "Throughput"))
    ax.legend(fontsize="small")
    return fig


def scaling_figure(doc: Mapping[str, Any], ok: Sequence[Mapping[str, Any]],
                   base: Mapping[str, Any], what: str) -> Figure:
    """Speedup (ideal P / P_base) or efficiency (ideal 1) against ranks."""
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.subplots()
    for i, (key, members) in enumerate(series(ok, base).items()):
        ax.plot([p["ranks"] for p in members], [p[what] for p in members],
                label=series_label(key, members), **_style(i))
    ranks = sorted({p["ranks"] for p in ok})
    ideal = [r / base["ranks"] for r in ranks] if what == "speedup" else [1.0] * len(ranks)
    ax.plot(ranks, ideal, "k--", lw=1, label="ideal")
    _rank_axis(ax, ok)
    ax.set_ylabel(f"{what} vs {base['name']}")
    if what == "efficiency":
        ax.set_ylim(bottom=0)
    ax.set_title(_title(doc, what.capitalize()))
    ax.legend(fontsize="small")
    return fig


def breakdown_figure(ok: Sequence[Mapping[str, Any]]) -> Figure:
    """Stacked seconds per phase of each point's median step; predicted beside (hatched)."""
    fig = Figure(figsize=(max(6.4, 0.9 * len(ok) + 2.5), 4.6), layout="constrained")
    ax = fig.subplots()
    predicted = any(p.get("predicted") for p in ok)
    width = 0.38 if predicted else 0.7
    shift = width / 2 if predicted else 0.0
    for x, point in enumerate(ok):
        _stack(ax, x - shift, width, point["measured"]["time_s"], label=x == 0)
        if point.get("predicted"):
            _stack(ax, x + shift, width, point["predicted"]["time_s"], label=False,
                   hatch="//", alpha=0.55)
    ax.set_xticks(range(len(ok)), [p["name"] for p in ok], rotation=30, ha="right")
    ax.set_ylim(0, HEADROOM * max(_tallest(ok), 1e-12))
    ax.set_ylabel("seconds per step")
    ax.set_title("Time per step by phase" +
                 (" (left: measured, right hatched: predicted)" if predicted else ""))
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def _tallest(ok: Sequence[Mapping[str, Any]]) -> float:
    """The tallest stacked bar, measured or predicted (its zero-height phases stacked on
    top pin matplotlib's autoscale to it, so the limit is set by hand with headroom)."""
    return max(sum(float(v) for v in p[kind]["time_s"].values())
               for p in ok for kind in ("measured", "predicted") if p.get(kind))


def _stack(ax: Any, x: float, width: float, seconds: Mapping[str, float], label: bool,
           **style: Any) -> None:
    bottom = 0.0
    for phase in TIME_KEYS:
        value = float(seconds.get(phase, 0.0))
        ax.bar(x, value, width, bottom=bottom, color=PHASE_COLOURS[phase],
               label=phase if label else None, **style)
        bottom += value


def predicted_figure(ok: Sequence[Mapping[str, Any]]) -> Figure:
    """Predicted against measured step time, log-log, with the line y = x."""
    pairs = [(p["measured"]["step_s"], p["predicted"]["step_s"], p["name"])
             for p in ok if p.get("predicted") and p["measured"]["step_s"] > 0
             and p["predicted"]["step_s"] > 0]
    fig = Figure(figsize=(5.6, 5.0), layout="constrained")
    ax = fig.subplots()
    ax.scatter([m for m, _, _ in pairs], [q for _, q, _ in pairs], zorder=3)
    for m, q, name in pairs:
        ax.annotate(name, (m, q), textcoords="offset points", xytext=(4, 4),
                    fontsize="x-small")
    values = [v for m, q, _ in pairs for v in (m, q)] or [1.0]
    low, high = min(values) / 1.5, max(values) * 1.5
    ax.plot([low, high], [low, high], "k--", lw=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("measured s / step")
    ax.set_ylabel("predicted s / step")
    ax.set_title("Measured vs predicted step time")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    return fig
