"""Rank 0's view of a training run: live progress, validation lines and a summary table.

A member of the run's bus (``outputs/observers.py``): it learns the run's length at
``run_start``, shows each train or validation record it is told (``update``; the records
of ``metrics.jsonl``, :mod:`cosmotrain.train.outputs.metrics`) and the summary at
``run_stop`` (``finish``).  In a terminal the train records drive a Rich progress bar; when
stdout is a pipe (``mpiexec``, ``srun``, batch logs) they become plain lines, about twenty
over the run, so logs stay short and greppable.  A rank other than 0 gets a silent
instance.  The epoch shown is the record's own, counted from 1 (the epoch in progress; for
validation, the epoch just finished): ``metrics.py`` states the convention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn,
                           TimeRemainingColumn)
from rich.table import Table

from cosmotrain.console import is_terminal, make_console
from cosmotrain.train.outputs.metrics import TIME_KEYS
from cosmotrain.train.outputs.observers import Observer, RunStart

PLAIN_LINES = 20


class TrainProgress(Observer):
    """Shows train/validation records as they come and the summary at the end.

    ``total_steps``: the run's (``run_start`` sets it from the :class:`RunStart`);
    ``terminal`` None asks whether stdout is a terminal; ``every`` is the plain-line period
    in steps (default: ``total_steps / 20``).  ``close`` (the bus's, also when the run
    fails; or use it as a context manager) stops the live bar and leaves the terminal usable.
    """

    def __init__(self, total_steps: int = 0, *, rank: int = 0, console: Console | None = None,
                 terminal: bool | None = None, every: int | None = None) -> None:
        self.enabled = rank == 0
        self.console = console if console is not None else make_console(rank)
        self.terminal = is_terminal() if terminal is None else terminal
        self._every = every
        self._set_total(total_steps)
        self._next_line = 0
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def _set_total(self, total_steps: int) -> None:
        self.total = total_steps
        self.every = self._every if self._every is not None else \
            max(1, math.ceil(total_steps / PLAIN_LINES))

    def run_start(self, run: RunStart) -> None:
        self._set_total(run.total_steps)

    def record(self, record: Mapping[str, Any]) -> None:
        """Show a train or validation record; the summary waits for :meth:`run_stop`."""
        if record["kind"] != "summary":
            self.update(record)

    def run_stop(self, summary: Mapping[str, Any]) -> None:
        self.finish(summary)

    def update(self, record: Mapping[str, Any]) -> None:
        """Show one ``train`` or ``validation`` record."""
        if not self.enabled:
            return
        if record["kind"] == "validation":
            self._print(validation_line(record))
        elif record["kind"] != "train":
            raise ValueError(f"progress shows train and validation records, not "
                             f"{record['kind']!r}")
        elif self.terminal:
            self._advance(record)
        elif record["step"] >= self._next_line or record["step"] == self.total:
            self._print(train_line(record, self.total))
            self._next_line = (record["step"] // self.every + 1) * self.every

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Stop the live display and print the summary table."""
        self.close()
        if self.enabled:
            self.console.print(summary_table(summary))

    def close(self) -> None:
        """Stop the live bar (idempotent)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _advance(self, record: Mapping[str, Any]) -> None:
        if self._bar is None:
            self._bar = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("epoch {task.fields[epoch]}"), TextColumn("loss {task.fields[loss]}"),
                TextColumn("lr {task.fields[lr]}"), TextColumn("{task.fields[rate]} samples/s"),
                TimeRemainingColumn(), console=self.console)
            self._task = self._bar.add_task("train", total=self.total, **_bar_fields(record))
            self._bar.start()
        assert self._task is not None
        self._bar.update(self._task, completed=record["step"], **_bar_fields(record))


def _bar_fields(record: Mapping[str, Any]) -> dict[str, str]:
    return {"epoch": str(record["epoch"]), "loss": _num(record["loss"], ".4g"),
            "lr": _num(record["lr"], ".3g"), "rate": _num(record["samples_per_s"], ".1f")}


def _num(value: float | None, spec: str) -> str:
    """Format a number; a null (non-finite) value reads nan."""
    return "nan" if value is None else format(value, spec)


def _shares(times: Mapping[str, float]) -> str:
    """Each phase's share of the step, phases that took no time left out."""
    total = sum(times.values())
    return ", ".join(f"{key} {100 * times[key] / total:.0f}%" for key in TIME_KEYS
                     if times[key] > 0) if total > 0 else "no time recorded"


def train_line(record: Mapping[str, Any], total_steps: int) -> str:
    """One plain line for a train record (non-terminal output); mem is the highest rank's."""
    return (f"step {record['step']}/{total_steps} | epoch {record['epoch']} | "
            f"loss {_num(record['loss'], '.4g')} | lr {_num(record['lr'], '.3g')} | "
            f"{record['samples_per_s']:.1f} samples/s | {record['step_time_s']:.3g} s/step "
            f"({_shares(record['time_s'])}) | mem {max(record['memory_hwm_mib']):.0f} MiB")


def validation_line(record: Mapping[str, Any]) -> str:
    """One line for a validation record (printed above the bar in a terminal)."""
    per_param = ", ".join(_num(v, ".4g") for v in record["mae_per_param"])
    return (f"validation epoch {record['epoch']} step {record['step']} | "
            f"mse {_num(record['mse'], '.4g')} | mae {_num(record['mae'], '.4g')} "
            f"[{per_param}] | {record['wall_s']:.1f} s")


def summary_table(summary: Mapping[str, Any]) -> Table:
    """The end-of-run table: counters, throughput, quality, time shares and memory."""
    table = Table(title="Training summary", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")
    for label, value in _summary_rows(summary):
        table.add_row(label, value)
    return table


def _summary_rows(s: Mapping[str, Any]) -> list[tuple[str, str]]:
    best = "-" if s["best_mae"] is None else \
        f"{s['best_mae']:.4g} (epoch {s['best_mae_epoch']})"
    rows = [("stopped", s["stop_reason"].replace("_", " ")), ("steps", str(s["step"])),
            ("last epoch", str(s["epoch"])), ("samples", str(s["samples"])),
            ("ranks", str(s["ranks"])), ("wall time", f"{s['wall_s']:.1f} s"),
            ("throughput", f"{s['samples_per_s']:.1f} samples/s"),
            ("final loss", _num(s["final_loss"], ".4g")), ("best validation MAE", best)]
    total = sum(s["time_s"].values())
    rows += [(f"time {key}", f"{s['time_s'][key]:.2f} s "
              f"({100 * s['time_s'][key] / total if total > 0 else 0:.0f}%)")
             for key in TIME_KEYS]
    rows.append(("memory high-water", _memory_text(s["memory_hwm_mib"])))
    return rows


def _memory_text(per_rank: Sequence[float]) -> str:
    if len(per_rank) == 1:
        return f"{per_rank[0]:.0f} MiB"
    return f"max {max(per_rank):.0f} / min {min(per_rank):.0f} MiB over {len(per_rank)} ranks"
