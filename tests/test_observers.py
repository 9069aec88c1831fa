"""The trainer's observer events (what MLPerf logging and TensorBoard listen to): their
order over epochs, validation and the end, and a resumed run's first epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi4py import MPI

from cosmotrain.config.load import load_config
from cosmotrain.train import runner
from cosmotrain.train.outputs.observers import Observer, Observers, RunStart


class Recorder(Observer):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def run_start(self, run: RunStart) -> None:
        self.events.append(("run_start", run.first_step, run.steps_per_epoch, run.resumed,
                            run.train_samples, run.eval_samples, run.ranks, run.nodes))

    def epoch_start(self, epoch: int) -> None:
        self.events.append(("epoch_start", epoch))

    def epoch_stop(self, epoch: int) -> None:
        self.events.append(("epoch_stop", epoch))

    def eval_start(self, epoch: int) -> None:
        self.events.append(("eval_start", epoch))

    def eval_stop(self, epoch: int) -> None:
        self.events.append(("eval_stop", epoch))

    def record(self, record) -> None:
        self.events.append(("record", record["kind"]))

    def run_stop(self, summary) -> None:
        self.events.append(("run_stop", summary["stop_reason"]))

    def close(self) -> None:
        self.events.append(("close",))


def train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str,
          resume: bool = False) -> list[tuple]:
    recorder = Recorder()
    monkeypatch.setattr(runner, "make_observers", lambda cfg, out, rank, *_: Observers([recorder]))
    cfg = load_config(REPO_TINY, ["data.source=synthetic", "data.synthetic.samples=10",
                                  "data.synthetic.val_fraction=0.2", "model.width=8",
                                  "train.batch_size=4", "train.log_every=1",
                                  f"output.dir={tmp_path / 'run'}", *extra])
    runner.run_training(cfg, MPI.COMM_WORLD, resume=resume)
    return recorder.events


REPO_TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def test_events_follow_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = train(tmp_path, monkeypatch, "train.epochs=2", "train.max_steps=null")
    assert events[0] == ("run_start", 0, 2, False, 8, 2, 1, 1)
    step, epoch_1 = ("record", "train"), [("epoch_start", 1), ("record", "train"),
                                          ("record", "train"), ("epoch_stop", 1)]
    validation = [("eval_start", 1), ("eval_stop", 1), ("record", "validation")]
    assert events[1:8] == epoch_1 + validation
    assert events[8:15] == [("epoch_start", 2), step, step, ("epoch_stop", 2),
                            ("eval_start", 2), ("eval_stop", 2), ("record", "validation")]
    assert events[15:] == [("record", "summary"), ("run_stop", "completed"), ("close",)]


def test_a_resumed_run_starts_in_the_epoch_it_resumes_into(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train(tmp_path, monkeypatch, "train.epochs=2", "train.max_steps=3",
          "train.checkpoint_every_steps=1")
    events = train(tmp_path, monkeypatch, "train.epochs=2", "train.max_steps=null",
                   "train.checkpoint_every_steps=1", resume=True)
    assert events[0] == ("run_start", 3, 2, True, 8, 2, 1, 1)
    assert events[1:4] == [("epoch_start", 2), ("record", "train"), ("epoch_stop", 2)]
    assert events[-3:] == [("record", "summary"), ("run_stop", "completed"), ("close",)]
