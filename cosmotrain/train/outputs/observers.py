"""The observer bus of a training run: every output listens to the same events.

The trainer tells its bus, an :class:`Observers` (rank 0's; the other ranks get the silent
base class), about the run as it happens, each event and each record once; every output
is a member of it: ``metrics.jsonl`` (``metrics.MetricsFile``), the console
(``progress.TrainProgress``), TensorBoard and the MLPerf log.  The events:

- ``run_start(run)``: set-up done, the first step about to run (a :class:`RunStart`);
- ``epoch_start(epoch)`` / ``epoch_stop(epoch)``: ``epoch`` counts from 1 (the epoch in
  progress, or just finished); a resumed run starts with the epoch it resumes into;
- ``eval_start(epoch)`` / ``eval_stop(epoch)``: around a validation pass (``epoch`` as in
  its record: the epoch just finished, or the one a run stopped within validates at its end);
- ``record(record)``: every record of the run (train, validation, summary: the schemas
  of ``metrics.jsonl``, ``outputs/metrics.py``), once, as it is made;
- ``run_stop(summary)``: the run ended (``summary["stop_reason"]``), then ``close()``.

An observer only observes: it never changes the trajectory, and the training loop calls it
on rank 0 only, so it needs no collective.  The bus is made where the run is assembled
(``train/run.py``, :func:`~cosmotrain.train.run.make_observers` for the outputs the
``output`` section asks for), so this module imports none of its members: a new output
format is one new module in ``train/outputs/`` and its line there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosmotrain.config.schema import Config
from cosmotrain.device.select import Device


@dataclass(frozen=True)
class RunStart:
    """What an observer may want to know about a run before its first step."""

    cfg: Config
    out_dir: Path
    ranks: int
    nodes: int
    train_samples: int
    eval_samples: int
    steps_per_epoch: int
    total_steps: int
    first_step: int  # 0, or the step a resumed run continues from
    resumed: bool
    device: Device | None = None  # rank 0's: CPU or GPU, ranks sharing its GPU


class Observer:
    """The silent observer: every event is accepted and ignored (override what you need)."""

    def run_start(self, run: RunStart) -> None:
        """Set-up is done and the first step is about to run."""

    def epoch_start(self, epoch: int) -> None:
        """Epoch ``epoch`` (from 1) begins."""

    def epoch_stop(self, epoch: int) -> None:
        """Epoch ``epoch`` (from 1) has taken its last step."""

    def eval_start(self, epoch: int) -> None:
        """A validation pass after epoch ``epoch`` begins."""

    def eval_stop(self, epoch: int) -> None:
        """The validation pass after epoch ``epoch`` ended (its record follows)."""

    def record(self, record: Mapping[str, Any]) -> None:
        """A metrics record (train, validation or summary), as written to metrics.jsonl."""

    def run_stop(self, summary: Mapping[str, Any]) -> None:
        """The run ended; ``summary`` is its summary record."""

    def close(self) -> None:
        """Release files and writers (called once, last)."""


class Observers(Observer):
    """The bus: several observers, each told every event in order (a member may itself
    be a bus)."""

    def __init__(self, members: Sequence[Observer] = ()) -> None:
        self.members = list(members)

    def run_start(self, run: RunStart) -> None:
        for member in self.members:
            member.run_start(run)

    def epoch_start(self, epoch: int) -> None:
        for member in self.members:
            member.epoch_start(epoch)

    def epoch_stop(self, epoch: int) -> None:
        for member in self.members:
            member.epoch_stop(epoch)

    def eval_start(self, epoch: int) -> None:
        for member in self.members:
            member.eval_start(epoch)

    def eval_stop(self, epoch: int) -> None:
        for member in self.members:
            member.eval_stop(epoch)

    def record(self, record: Mapping[str, Any]) -> None:
        for member in self.members:
            member.record(record)

    def run_stop(self, summary: Mapping[str, Any]) -> None:
        for member in self.members:
            member.run_stop(summary)

    def close(self) -> None:
        for member in self.members:
            member.close()
