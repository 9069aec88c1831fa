"""TensorBoard event files of a training run (``output.tensorboard: true``; tensorboardX).

The scalars are the ``metrics.jsonl`` records, tagged by what they measure, at the global
step the record carries (steps completed) and the wall time it was written:

- ``train/loss``, ``train/lr``, ``train/samples_per_s``, ``train/step_time_s``;
- ``time/<phase>``: the seconds per step of each phase of ``TIME_KEYS`` (compute, halo,
  allreduce, redistribution, channel, io_wait, other);
- ``memory/hwm_mib_max``: the largest memory high-water mark over the ranks;
- ``validation/mse``, ``validation/mae`` (the means over the targets) and
  ``validation/mse_target<i>``, ``validation/mae_target<i>`` per target.

A value the log holds as ``null`` (a diverged loss) is written as NaN, so the divergence
shows.  Only rank 0 writes (the observers are rank 0's), into ``<output.dir>/tensorboard/``.

A resumed run writes a new event file into the same directory, opened with
``purge_step`` = the first step it will log (the checkpoint's step + 1): TensorBoard drops
the older files' events from that step on, exactly as ``metrics.jsonl`` is cut back to the
checkpoint, so each curve continues as one.  A fresh run purges from step 0, so events a
crashed earlier run left in the directory never mix into the new curves.  tensorboardX
names a file by the second it was opened (and truncates a file of that name), so each name
ends with the nanosecond clock too: two runs in one second neither clobber each other nor
sort out of order (TensorBoard reads the files in name order).
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cosmotrain.errors import UserError
from cosmotrain.train.outputs.metrics import TIME_KEYS
from cosmotrain.train.outputs.observers import Observer, RunStart

TENSORBOARD_DIR = "tensorboard"
INSTALL_HINT = 'pip install -e ".[tensorboard]"'
FLUSH_SECONDS = 30


def require_tensorboardx() -> None:
    """Raise a one-line UserError when tensorboardX is not installed.

    Called on every rank (the same environment gives the same answer), so a missing
    package stops the whole job before training rather than rank 0 alone."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise UserError(f"output.tensorboard: true needs tensorboardX, which is not "
                        f"installed; {INSTALL_HINT}, or set output.tensorboard: false")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics record, by tag (a summary record has none:
    its numbers are the curves' totals)."""
    if record["kind"] == "train":
        values = {"train/loss": record["loss"], "train/lr": record["lr"],
                  "train/samples_per_s": record["samples_per_s"],
                  "train/step_time_s": record["step_time_s"],
                  "memory/hwm_mib_max": max(record["memory_hwm_mib"])}
        values.update({f"time/{key}": record["time_s"][key] for key in TIME_KEYS})
    elif record["kind"] == "validation":
        values = {"validation/mse": record["mse"], "validation/mae": record["mae"]}
        for metric in ("mse", "mae"):
            values.update({f"validation/{metric}_target{i}": value
                           for i, value in enumerate(record[f"{metric}_per_param"])})
    else:
        return {}
    return {tag: math.nan if value is None else float(value) for tag, value in values.items()}


class TensorBoardLog(Observer):
    """Writes every train and validation record as scalars (rank 0's observer)."""

    def __init__(self, out_dir: Path) -> None:
        require_tensorboardx()
        self.logdir = Path(out_dir) / TENSORBOARD_DIR
        self.writer: Any = None

    def run_start(self, run: RunStart) -> None:
        """Open the writer; a resumed run purges what an earlier file logged after its
        checkpoint (see the module docstring)."""
        from tensorboardX import SummaryWriter

        purge = run.first_step + 1 if run.resumed else 0
        self.writer = SummaryWriter(logdir=str(self.logdir), purge_step=purge,
                                    flush_secs=FLUSH_SECONDS,
                                    filename_suffix=f".{time.time_ns():020d}")

    def record(self, record: Mapping[str, Any]) -> None:
        if self.writer is None:
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"],
                                   walltime=record["time"])
        if record["kind"] == "validation":
            self.writer.flush()  # a validation pass is rare and worth seeing at once

    def run_stop(self, summary: Mapping[str, Any]) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()
