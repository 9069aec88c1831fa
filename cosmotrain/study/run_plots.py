"""PNG plots of one training run from its ``metrics.jsonl`` (``cosmotrain report``).

Four figures over the training step: the training loss (with the learning rate), the
validation MAE per target (and their mean), the throughput (samples/s) and the time
breakdown per step by phase (stacked).  matplotlib (a dependency) is imported only when
drawing, so a broken installation without it is a one-line error, as are a missing run
directory and a run without ``metrics.jsonl``.  Figures are built on an Agg canvas, never
pyplot (no display, no global backend state), like :mod:`cosmotrain.study.plots`.

A run continued with ``--resume`` appends to the same ``metrics.jsonl`` after cutting it
back to the checkpoint, so its records already read as one trajectory.  :func:`joined`
makes sure of it whatever wrote the file: the curve of each record kind has one point per
step, in step order, and a record whose step does not follow the previous one starts a
continuation that replaces what was logged from that step on (the later run is the one
that counts, as the resume's cut-back would have decided).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosmotrain.files.atomic import write_atomically
from cosmotrain.errors import UserError, WriteError
from cosmotrain.train.outputs.metrics import METRICS_FILE, TIME_KEYS, read_metrics

PLOTS_DIR = "plots"
LOSS_PNG, MAE_PNG = "loss.png", "validation_mae.png"
THROUGHPUT_PNG, BREAKDOWN_PNG = "throughput.png", "breakdown.png"
INSTALL_HINT = "it is a dependency of cosmotrain: reinstall cosmotrain (pip install -e .)"


@dataclass(frozen=True)
class RunCurves:
    """A run's records joined into curves: train and validation, one per step each."""

    train: list[dict[str, Any]]
    validation: list[dict[str, Any]]


def joined(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``records`` (of one kind, in file order) as one curve of strictly increasing steps;
    a step at or below the last kept one drops the kept records from that step on."""
    curve: list[dict[str, Any]] = []
    for record in records:
        while curve and curve[-1]["step"] >= record["step"]:
            curve.pop()
        curve.append(dict(record))
    return curve


def load_curves(run_dir: Path) -> RunCurves:
    """The curves of ``run_dir/metrics.jsonl``; a one-line UserError when there is no run
    or no training step logged."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"report: run directory '{run}' not found; pass the output.dir of "
                        f"a training run")
    path = run / METRICS_FILE
    if not path.is_file():
        raise UserError(f"report: '{run}' has no {METRICS_FILE}; pass the output.dir of a "
                        f"training run that has taken at least one step")
    records = read_metrics(path)
    curves = RunCurves(joined(r for r in records if r["kind"] == "train"),
                       joined(r for r in records if r["kind"] == "validation"))
    if not curves.train:
        raise UserError(f"report: {path} holds no train record yet; nothing to plot until "
                        f"the run has logged a step")
    return curves


def write_run_plots(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Draw the run's PNGs into ``out`` (default ``run_dir/plots``); the paths written (no
    validation MAE plot for a run without a validation record)."""
    curves = load_curves(run_dir)
    figure_type, canvas = _matplotlib()
    folder = Path(out) if out is not None else Path(run_dir) / PLOTS_DIR
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteError(folder, err, "--out") from None
    figures: list[tuple[str, Callable[[Any, RunCurves], None]]] = [
        (LOSS_PNG, draw_loss), (THROUGHPUT_PNG, draw_throughput),
        (BREAKDOWN_PNG, draw_breakdown)]
    if curves.validation:
        figures.insert(1, (MAE_PNG, draw_validation))
    written = []
    for name, draw in figures:
        fig = figure_type(figsize=(6.8, 4.4), layout="constrained")
        canvas(fig)
        draw(fig, curves)
        written.append(write_atomically(folder / name,
                                        lambda tmp: fig.savefig(tmp, format="png", dpi=110),
                                        "--out"))
    return written


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas, or a one-line UserError naming the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(f"report: the plots need matplotlib, which cannot be imported; "
                        f"{INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def steps(curve: Sequence[Mapping[str, Any]]) -> list[int]:
    return [r["step"] for r in curve]


def _values(curve: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """``key`` of each record, NaN for null (matplotlib leaves a gap)."""
    return [float("nan") if r[key] is None else float(r[key]) for r in curve]


def _marks(curve: Sequence[Any]) -> dict[str, Any]:
    """Markers on a short curve (a single point would not show as a line)."""
    return {"marker": "o", "markersize": 3} if len(curve) <= 50 else {}


def _axes(fig: Any, title: str, ylabel: str) -> Any:
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return ax


def draw_loss(fig: Any, curves: RunCurves) -> None:
    """Training loss (log scale when positive) and, on the right, the learning rate."""
    ax = _axes(fig, "Training loss", "loss (mean over the logged steps)")
    loss = _values(curves.train, "loss")
    ax.plot(steps(curves.train), loss, color="#4c72b0", label="loss",
            **_marks(curves.train))
    if all(v > 0 for v in loss if v == v) and any(v == v for v in loss):
        ax.set_yscale("log")
    lr = ax.twinx()
    lr.plot(steps(curves.train), _values(curves.train, "lr"), color="#8c8c8c", ls="--",
            lw=1, label="learning rate")
    lr.set_ylabel("learning rate")
    lr.set_ylim(0, 1.25 * max(max(_values(curves.train, "lr")), 1e-12))  # under the legend
    handles = ax.get_legend_handles_labels()[0] + lr.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize="small")


def draw_validation(fig: Any, curves: RunCurves) -> None:
    """Validation MAE of each target, and their mean in black."""
    ax = _axes(fig, "Validation MAE", "mean absolute error")
    x = steps(curves.validation)
    targets = len(curves.validation[0]["mae_per_param"])
    for i in range(targets):
        ax.plot(x, [_nan(r["mae_per_param"][i]) for r in curves.validation], marker="o",
                markersize=4, label=f"target {i}")
    ax.plot(x, _values(curves.validation, "mae"), color="black", lw=2.5, marker="s",
            markersize=5, label="mean")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def draw_throughput(fig: Any, curves: RunCurves) -> None:
    ax = _axes(fig, "Throughput", "samples / s")
    ax.plot(steps(curves.train), _values(curves.train, "samples_per_s"), color="#55a868",
            **_marks(curves.train))
    ax.set_ylim(bottom=0)


def draw_breakdown(fig: Any, curves: RunCurves) -> None:
    """Seconds per step by phase, stacked, with headroom above the tallest step."""
    from cosmotrain.study.plots import PHASE_COLOURS

    ax = _axes(fig, "Time per step by phase", "seconds per step")
    seconds = [[r["time_s"][key] for r in curves.train] for key in TIME_KEYS]
    ax.stackplot(steps(curves.train), seconds, labels=TIME_KEYS,
                 colors=[PHASE_COLOURS[key] for key in TIME_KEYS])
    tallest = max((sum(column) for column in zip(*seconds)), default=0.0)
    ax.set_ylim(0, tallest * 1.12 if tallest > 0 else 1.0)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
