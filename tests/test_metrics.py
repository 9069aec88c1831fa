"""metrics.jsonl records and their schema, the log file (flush, resume), the memory
high-water mark, and the progress display (plain lines, live bar, summary table)."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from cosmotrain.runtime.timers import PhaseTimers
from cosmotrain.errors import DataError
from cosmotrain.train.outputs.metrics import (RECORD_SCHEMAS, TIME_KEYS, MetricsLog, epoch_of,
                                               memory_hwm_mib, metrics_path, read_metrics,
                                               summary_record, time_breakdown, train_record,
                                               validate_record, validation_record)
from cosmotrain.train.outputs.progress import TrainProgress, summary_table

TIMES = {**dict.fromkeys(TIME_KEYS, 0.0), "compute": 0.05, "halo": 0.01, "allreduce": 0.02,
         "io_wait": 0.005, "other": 0.001}


def train(step: int, loss: float = 0.5, **extra: Any) -> dict[str, Any]:
    args = dict(step=step, epoch=epoch_of(step, 10), samples=4 * step, loss=loss, lr=1e-3,
                samples_per_s=80.0, time_s=TIMES, memory_hwm_mib=[512.0, 480.5])
    return train_record(**{**args, **extra})


def validation(step: int = 10, epoch: int = 1) -> dict[str, Any]:
    return validation_record(step=step, epoch=epoch, samples=16,
                             mse_per_param=[0.01, 0.02, 0.03, 0.04],
                             mae_per_param=[0.1, 0.12, 0.14, 0.16], wall_s=1.5)


def summary(**extra: Any) -> dict[str, Any]:
    args = dict(step=40, epoch=3, samples=160, ranks=4, wall_s=12.0, samples_per_s=13.3,
                final_loss=0.25, best_mae=0.1234, best_mae_epoch=3, stop_reason="target_mae",
                time_s={k: 10 * v for k, v in TIMES.items()},
                memory_hwm_mib=[512.0, 480.5, 500.0, 490.0])
    return summary_record(**{**args, **extra})


def test_builders_make_valid_records() -> None:
    rec = train(3, steps=2)
    assert rec["kind"] == "train" and rec["steps"] == 2
    assert rec["step_time_s"] == pytest.approx(sum(TIMES.values()))
    assert list(rec["time_s"]) == list(TIME_KEYS)
    val = validation()
    assert val["mse"] == pytest.approx(0.025) and val["mae"] == pytest.approx(0.13)
    assert summary()["stop_reason"] == "target_mae"
    assert set(RECORD_SCHEMAS) == {"train", "validation", "summary"}


def test_epoch_is_the_epoch_of_the_step_from_1() -> None:
    """10 steps an epoch: steps 1-10 are epoch 1 (step 10 ends it), 11 starts epoch 2."""
    assert [epoch_of(step, 10) for step in (0, 1, 9, 10, 11, 20, 21)] == [0, 1, 1, 1, 2, 2, 3]


def test_numpy_scalars_and_non_finite_values() -> None:
    rec = train(1, loss=np.float32(np.nan), lr=np.float64(2e-3))
    assert rec["loss"] is None and type(rec["lr"]) is float
    json.dumps(rec, allow_nan=False)                 # strict JSON
    val = validation_record(step=1, epoch=1, samples=2, mse_per_param=[np.inf, 1.0],
                            mae_per_param=[1.0, 1.0], wall_s=0.1)
    assert val["mse_per_param"] == [None, 1.0] and val["mse"] is None
    assert val["mae"] == 1.0


def _broken(record: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    bad = copy.deepcopy(record)
    *parents, leaf = path.split(".")
    node = bad
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[leaf]
    else:
        node[leaf] = value
    return bad


@pytest.mark.parametrize("make, path, value, words", [
    (train, "loss", KeyError, "'loss' is missing"),
    (train, "extra", 1, "'extra' is not in the schema"),
    (train, "step", "7", "'step' must be integer"),
    (train, "step", True, "'step' must be integer"),
    (train, "step", -1, "'step' must be >= 0"),
    (train, "steps", 0, "'steps' must be >= 1"),
    (train, "lr", math.nan, "'lr' must be number"),
    (train, "time_s.halo", -0.1, "'time_s.halo' must be >= 0"),
    (train, "time_s.io", 0.1, "'time_s.io' is not in the schema"),
    (train, "time_s.other", KeyError, "'time_s.other' is missing"),
    (train, "memory_hwm_mib", [], "needs at least 1"),
    (train, "memory_hwm_mib", [1.0, "x"], "'memory_hwm_mib[1]' must be number"),
    (train, "kind", "step", "'kind' must be one of"),
    (validation, "mae_per_param", [0.1], "differ in length"),
    (validation, "mse", "0.1", "'mse' must be number or null"),
    (summary, "stop_reason", "bored", "'stop_reason' must be one of"),
    (summary, "best_mae_epoch", 1.5, "'best_mae_epoch' must be integer or null"),
])
def test_validator_rejects_malformed_records(make, path: str, value: Any, words: str) -> None:
    record = make(5) if make is train else make()
    validate_record(record)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        validate_record(_broken(record, path, value))


def test_validator_rejects_non_objects() -> None:
    for thing in ([1, 2], "train", None, {"kind": "train"}):
        with pytest.raises(ValueError):
            validate_record(thing)  # type: ignore[arg-type]


def test_time_breakdown_leaves_the_rest_to_compute() -> None:
    timers = PhaseTimers()
    timers.seconds.update(halo=0.1, allreduce=0.2, alltoall=0.05)
    times = time_breakdown(1.0, timers.take(), io_wait_s=0.15, other_s=0.05)
    assert list(times) == list(TIME_KEYS)
    assert times["other"] == pytest.approx(0.1)            # unknown phase counted as other
    assert times["compute"] == pytest.approx(0.45)
    assert sum(times.values()) == pytest.approx(1.0)
    assert time_breakdown(0.1, {"halo": 0.3})["compute"] == 0.0


def test_memory_high_water_mark() -> None:
    first = memory_hwm_mib()
    block = np.ones(16 * 2**20 // 8)                      # touch 16 MiB
    second = memory_hwm_mib()
    assert 1.0 < first <= second < 1e7 and block.sum() > 0
    status = Path("/proc/self/status")
    if sys.platform.startswith("linux") and status.exists():
        hwm_kib = next(int(line.split()[1]) for line in status.read_text().splitlines()
                       if line.startswith("VmHWM:"))
        assert memory_hwm_mib() == pytest.approx(hwm_kib / 1024, rel=0.05)


def test_log_writes_one_flushed_line_per_record(tmp_path: Path) -> None:
    path = metrics_path(tmp_path / "run")
    log = MetricsLog(path)
    log.write(train(1))
    assert json.loads(path.read_text().splitlines()[0])["step"] == 1     # before close
    log.write(validation(step=1))
    with pytest.raises(ValueError):
        log.write({"kind": "train", "step": 2})
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(line.startswith("{") for line in lines)
    assert [r["kind"] for r in read_metrics(path)] == ["train", "validation"]
    assert [r["step"] for r in read_metrics(path, kind="train")] == [1]
    with pytest.raises(ValueError, match="closed"):
        log.write(train(3))


def test_fresh_log_replaces_and_resume_trims(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for step in range(1, 11):
            log.write(train(step))
            if step == 5:
                log.write(validation(step=5))
        log.write(summary(step=10))
    with open(path, "a") as handle:
        handle.write('{"kind": "train", "st')                      # cut by a crash
    with MetricsLog(path, resume_step=6) as log:
        log.write(train(7))
    records = read_metrics(path)
    assert [(r["kind"], r["step"]) for r in records] == \
        [("train", s) for s in range(1, 6)] + [("validation", 5), ("train", 6), ("train", 7)]
    assert not any(r["kind"] == "summary" for r in records)
    MetricsLog(path).close()
    assert path.read_text() == ""


def test_read_metrics_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(train(1)) + "\n" + '{"kind": "train"}\n')
    with pytest.raises(DataError, match=r"metrics.jsonl'.*line 2"):
        read_metrics(path)
    with pytest.raises(DataError, match="not found"):
        read_metrics(tmp_path / "none.jsonl")


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=terminal, width=160, highlight=False), buffer


def test_plain_lines_when_not_a_terminal() -> None:
    console, out = _console(False)
    with TrainProgress(100, console=console, terminal=False) as progress:
        for step in range(1, 101):
            progress.update(train(step))
            if step % 50 == 0:
                progress.update(validation(step=step, epoch=epoch_of(step, 10)))
        progress.finish(summary())
    text = out.getvalue()
    assert "\x1b" not in text                                          # no control codes
    lines = text.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == \
        ["1/100"] + [f"{s}/100" for s in range(5, 101, 5)]            # ~20 lines, and the end
    assert "loss 0.5 | lr 0.001 | 80.0 samples/s" in steps[0]
    assert "halo 12%" in steps[0] and "mem 512 MiB" in steps[0]
    assert "redistribution" not in steps[0]                           # phases at 0 s omitted
    vals = [line for line in lines if line.startswith("validation ")]
    assert len(vals) == 2 and "[0.1, 0.12, 0.14, 0.16]" in vals[0]
    assert "Training summary" in text


def test_plain_lines_follow_sparse_records() -> None:
    console, out = _console(False)
    progress = TrainProgress(1000, console=console, terminal=False, every=100)
    for step in (10, 60, 120, 130, 260, 1000):
        progress.update(train(step))
    assert [line.split()[1] for line in out.getvalue().splitlines()] == \
        ["10/1000", "120/1000", "260/1000", "1000/1000"]


def test_live_bar_in_a_terminal() -> None:
    console, out = _console(True)
    with TrainProgress(30, console=console, terminal=True) as progress:
        for step in range(1, 31):
            progress.update(train(step, loss=1.0 / step))
        progress.update(validation(step=30, epoch=3))
        progress.finish(summary())
    text = out.getvalue()
    assert "\x1b[" in text and "30/30" in text and "loss 0.03333" in text
    assert "validation epoch 3 step 30" in text and "Training summary" in text


def test_live_bar_stops_on_error() -> None:
    console, _ = _console(True)
    with pytest.raises(RuntimeError):
        with TrainProgress(5, console=console, terminal=True) as progress:
            progress.update(train(1))
            assert progress._bar is not None
            raise RuntimeError("step failed")
    assert progress._bar is None


def test_other_ranks_are_silent() -> None:
    console, out = _console(False)
    progress = TrainProgress(10, rank=1, console=console, terminal=False)
    progress.update(train(1))
    progress.update(validation())
    progress.finish(summary())
    assert out.getvalue() == ""
    with pytest.raises(ValueError, match="summary"):
        TrainProgress(10, console=console, terminal=False).update(summary())


def test_summary_table_renders() -> None:
    console, out = _console(False)
    console.print(summary_table(summary()))
    text = out.getvalue()
    for words in ("Training summary", "target mae", "best validation MAE",
                  "0.1234 (epoch 3)", "13.3 samples/s", "time allreduce", "0.20 s (23%)",
                  "max 512 / min 480 MiB over 4 ranks"):
        assert words in text, words
    console.print(summary_table(summary(best_mae=None, best_mae_epoch=None, final_loss=None,
                                        memory_hwm_mib=[100.0])))
    assert "100 MiB" in out.getvalue()


def test_documented_example_lines_are_valid() -> None:
    """docs/TRAINING.md's example metrics.jsonl lines obey the schema (docs stay in sync)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "TRAINING.md").read_text()
    block = text.split("```json\n", 1)[1].split("```", 1)[0]
    records = ["{" + part.replace("\n", "") for part in block.split("\n{")]
    records[0] = records[0][1:]
    kinds = []
    for line in records:
        record = json.loads(line)
        validate_record(record)
        kinds.append(record["kind"])
    assert kinds == ["train", "validation", "summary"]


def test_each_record_is_one_write_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    calls: list[bytes] = []
    real = os.write

    def spy(fd: int, data: bytes) -> int:
        calls.append(bytes(data))
        return real(fd, data)
    with MetricsLog(tmp_path / "metrics.jsonl") as log:
        monkeypatch.setattr(os, "write", spy)
        log.write(train(1))
        log.write(train(2))
        monkeypatch.undo()
    assert len(calls) == 2 and all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in calls)


@pytest.mark.parametrize("tail", ['{"kind": "train", "st', "", "VALID"])
def test_resume_drops_a_torn_last_line(tmp_path: Path, tail: str) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        for step in (1, 2):
            log.write(train(step))
    if tail == "VALID":                        # complete JSON but its newline never came
        tail = json.dumps(train(3), separators=(",", ":"))
    with open(path, "a") as handle:
        handle.write(tail)
    with MetricsLog(path, resume_step=10) as log:
        log.write(train(4))
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 4]
    assert path.read_text().endswith("}\n") and not (tmp_path / "metrics.jsonl.tmp").exists()
