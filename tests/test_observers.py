"""The trainer's observer bus (what metrics.jsonl, the console, MLPerf logging and
TensorBoard listen to): the events' order over epochs, validation and the end, a resumed
run's first epoch, and every record reaching a new observer once."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from mpi4py import MPI
from rich.console import Console

from cosmotrain.config.load import load_config
from cosmotrain.train import run as runner
from cosmotrain.train.outputs.metrics import (MetricsFile, metrics_path, read_metrics,
                                              time_breakdown, train_record)
from cosmotrain.train.outputs.observers import Observer, Observers, RunStart
from cosmotrain.train.outputs.progress import TrainProgress


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


class Records(Observer):
    """A new output: it registers on the bus and keeps what it is told."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def record(self, record) -> None:
        self.records.append(dict(record))


def test_a_new_observer_on_the_bus_receives_every_record_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """The records it gets are exactly metrics.jsonl's lines, each once and in order, and
    the console (another member of the same bus) shows each validation and the summary."""
    records = Records()
    monkeypatch.setattr(runner, "make_observers", lambda *_: Observers([records]))
    cfg = load_config(REPO_TINY, ["data.source=synthetic", "data.synthetic.samples=10",
                                  "data.synthetic.val_fraction=0.2", "model.width=8",
                                  "train.batch_size=4", "train.log_every=1", "train.epochs=2",
                                  "train.max_steps=null", f"output.dir={tmp_path / 'run'}"])
    runner.run_training(cfg, MPI.COMM_WORLD)
    assert records.records == read_metrics(metrics_path(tmp_path / "run"))
    assert [r["kind"] for r in records.records] == \
        ["train", "train", "validation", "train", "train", "validation", "summary"]
    out = capsys.readouterr().out
    assert out.count("validation epoch") == 2 and out.count("Training summary") == 1


def test_metrics_file_and_console_on_a_bus(tmp_path: Path) -> None:
    """Both built-in outputs take their settings from the run's start: the console its
    length, the metrics file whether to keep the records up to the resumed step."""
    def run(first: int, steps: range, text: StringIO) -> None:
        bus = Observers([MetricsFile(tmp_path),
                         TrainProgress(console=Console(file=text, width=200), terminal=False)])
        bus.run_start(RunStart(cfg=None, out_dir=tmp_path, ranks=1, nodes=1,  # type: ignore
                               train_samples=8, eval_samples=0, steps_per_epoch=4,
                               total_steps=4, first_step=first, resumed=first > 0))
        for step in steps:
            bus.record(train_record(step=step, epoch=1, samples=2 * step, loss=0.5, lr=0.1,
                                    samples_per_s=1.0, time_s=time_breakdown(1.0, {}),
                                    memory_hwm_mib=[1.0]))
        bus.close()

    first, resumed = StringIO(), StringIO()
    run(0, range(1, 4), first)
    run(2, range(3, 5), resumed)  # step 3 again, as after a resume from step 2
    steps = [r["step"] for r in read_metrics(metrics_path(tmp_path))]
    assert steps == [1, 2, 3, 4]
    assert "step 3/4" in first.getvalue() and "step 4/4" in resumed.getvalue()
