"""How a run begins and ends for its user: where the outputs go, the synthetic data made,
the validation at the end of a run stopped within an epoch, why there is no validation
MAE, and one epoch convention in metrics.jsonl (the epoch of the record's step, from 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi4py import MPI

from cosmotrain.config.load import load_config
from cosmotrain.errors import ConfigError
from cosmotrain.train import run as runner
from cosmotrain.train.outputs.observers import Observer, Observers

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
# 8 training samples in batches of 4: 2 steps an epoch; 2 validation samples
BASE = ["data.source=synthetic", "data.synthetic.samples=10", "data.synthetic.val_fraction=0.2",
        "model.width=8", "train.batch_size=4", "train.log_every=1", "train.epochs=3",
        "train.max_steps=null"]  # tiny.yaml stops at 3 steps


class Evals(Observer):
    def __init__(self) -> None:
        self.evals: list[tuple[str, int]] = []

    def eval_start(self, epoch: int) -> None:
        self.evals.append(("start", epoch))

    def eval_stop(self, epoch: int) -> None:
        self.evals.append(("stop", epoch))


def train(out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str, resume: bool = False
          ) -> tuple[list[dict], list[tuple[str, int]]]:
    observer = Evals()
    monkeypatch.setattr(runner, "make_observers", lambda *args: Observers([observer]))
    cfg = load_config(TINY, [*BASE, f"output.dir={out}", *extra])
    runner.run_training(cfg, MPI.COMM_WORLD, resume=resume)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], observer.evals


def kinds(records: list[dict], kind: str, key: str = "step") -> list:
    return [r[key] for r in records if r["kind"] == kind]


def test_max_steps_within_an_epoch_still_validates_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    records, evals = train(tmp_path / "run", monkeypatch, "train.max_steps=3")
    assert kinds(records, "validation") == [2, 3]            # epoch 1's end, then the run's
    assert kinds(records, "validation", "epoch") == [1, 2]   # the epoch step 3 lies in
    assert evals == [("start", 1), ("stop", 1), ("start", 2), ("stop", 2)]
    summary = records[-1]
    assert summary["stop_reason"] == "max_steps" and summary["best_mae"] is not None
    out = capsys.readouterr().out
    assert "best validation MAE" in out and "no validation MAE" not in out


def test_the_last_epoch_validates_even_when_validate_every_skips_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, _ = train(tmp_path / "run", monkeypatch, "train.validate_every=2")
    assert kinds(records, "validation") == [4, 6]            # epoch 2, then the end (epoch 3)
    assert kinds(records, "validation", "epoch") == [2, 3]


def test_no_second_validation_when_the_last_step_was_validated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, evals = train(tmp_path / "run", monkeypatch, "train.max_steps=4")
    assert kinds(records, "validation") == [2, 4] and len(evals) == 4


def test_every_record_carries_the_epoch_of_its_step_from_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records, _ = train(tmp_path / "run", monkeypatch)
    assert [(r["step"], r["epoch"]) for r in records if r["kind"] == "train"] == \
        [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)]
    assert kinds(records, "validation", "epoch") == [1, 2, 3]
    assert records[-1]["kind"] == "summary" and records[-1]["epoch"] == 3
    assert records[-1]["best_mae_epoch"] in (1, 2, 3)


def test_a_resumed_run_keeps_the_convention(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    train(out, monkeypatch, "train.max_steps=3", "train.checkpoint_every_steps=1")
    records, _ = train(out, monkeypatch, resume=True)
    steps = [(r["step"], r["epoch"]) for r in records if r["kind"] == "train"]
    assert steps == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (6, 3)]
    assert records[-1]["epoch"] == 3


def test_the_start_says_where_outputs_go_and_what_data_was_generated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    train(out, monkeypatch, "train.max_steps=1")
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (f"cosmotrain: outputs in {out}/: metrics.jsonl, checkpoints/, "
                       f"config.yaml (output.dir)")
    generated = [line for line in said if "synthetic samples" in line]
    assert len(generated) == 1
    assert generated[0].startswith("cosmotrain: generated 10 synthetic samples (8 train, "
                                   f"2 validation, 8^3, seed 1) in {out / 'data'} in ")
    assert generated[0].endswith(" s")
    train(out, monkeypatch, "train.max_steps=1", "train.epochs=1", resume=True)  # reused
    assert "synthetic samples" not in capsys.readouterr().out


def test_synthetic_data_made_with_other_settings_is_refused_not_reused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """output.dir/data is reused only for the settings it was generated with; otherwise a
    config error names what differs and how to generate it anew (the data stays)."""
    out = tmp_path / "run"
    train(out, monkeypatch, "train.max_steps=1")
    manifest = (out / "data" / "manifest.json").read_text()
    for extra, says in [("data.synthetic.seed=2", "seed 1 where the config asks for 2"),
                        ("data.synthetic.samples=12", "samples 10 where the config asks for 12"),
                        ("model.width=16", "width 8 where the config asks for 16")]:
        cfg = load_config(TINY, [*BASE, f"output.dir={out}", extra, "train.max_steps=1"])
        with pytest.raises(ConfigError) as err:
            runner.run_training(cfg, MPI.COMM_WORLD, overwrite=True)
        assert says in str(err.value) and str(err.value).startswith(
            "config key 'data.synthetic': the dataset already in ")
        assert f"remove or rename {out / 'data'} to generate it anew" in str(err.value)
    assert (out / "data" / "manifest.json").read_text() == manifest  # untouched
    (out / "data" / "manifest.json").write_text("[]")  # not a manifest: one line, no traceback
    cfg = load_config(TINY, [*BASE, f"output.dir={out}", "train.max_steps=1"])
    with pytest.raises(ConfigError, match="manifest.json cannot be read"):
        runner.run_training(cfg, MPI.COMM_WORLD, resume=True)
    (out / "data" / "manifest.json").write_text(manifest)
    train(out, monkeypatch, "train.max_steps=1", resume=True)  # the same settings: reused


@pytest.mark.parametrize("extra,reason", [
    (["train.validate_every=0"], "no validation MAE: train.validate_every is 0"),
    (["data.synthetic.val_fraction=0"], "no validation MAE: the dataset has no validation "
                                        "split"),
])
def test_no_validation_mae_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture, extra: list[str],
                                    reason: str) -> None:
    records, _ = train(tmp_path / "run", monkeypatch, "train.max_steps=3", *extra)
    assert kinds(records, "validation") == []
    assert reason in capsys.readouterr().out


def test_baseline_line_words() -> None:
    assert runner.baseline_line(None, None, "train.validate_every is 0") == \
        "no validation MAE: train.validate_every is 0"
    assert runner.baseline_line(0.2, 0.4).startswith("best validation MAE 0.2000 = 0.50 x")
    assert "baseline is 0" in runner.baseline_line(0.2, 0.0)
    assert runner.finished_line(8, 1) == (
        "cosmotrain: the run already finished at step 8 (1 epoch complete): nothing to do; "
        "raise train.epochs or train.max_steps to train further")
