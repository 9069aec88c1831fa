"""``cosmotrain train`` end to end, in subprocesses: metrics, resume, errors, aborts.

The tiny model on tiny synthetic cubes.  Resuming must continue the exact trajectory: the
losses of a run stopped and resumed equal those of the uninterrupted run, bit for bit on
the same layout and to float32 rounding on another layout and rank count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, mpiexec, subprocess_env

from cosmotrain.train.outputs.metrics import validate_record

BASE = ["model.name=tiny", "model.width=12", "data.source=synthetic",
        "data.synthetic.samples=20", "data.synthetic.val_fraction=0.2",
        "train.batch_size=4", "train.epochs=2", "optimizer.name=adam",
        "train.checkpoint_every_epochs=1", "train.keep_checkpoints=2"]


def train(out: Path, *extra: str, ranks: int = 1, resume: bool = False, env=None,
          timeout: float = 120) -> subprocess.CompletedProcess:
    sets = [arg for item in [*BASE, f"output.dir={out}", *extra] for arg in ("--set", item)]
    command = [sys.executable, "-m", "cosmotrain", "train", *sets]
    if resume:
        command.append("--resume")
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    return subprocess.run(command, cwd=REPO, env={**subprocess_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(out: Path) -> np.ndarray:
    return np.array([r["loss"] for r in records(out, "train")])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted reference run (2 epochs of 4 batches)."""
    out = tmp_path_factory.mktemp("straight")
    done = train(out)
    assert done.returncode == 0, done.stderr
    return out


def test_metrics_follow_the_schema(straight: Path) -> None:
    lines = (straight / "metrics.jsonl").read_text().splitlines()
    kinds = [json.loads(line)["kind"] for line in lines]
    for line in lines:
        validate_record(json.loads(line))
    assert kinds.count("train") == 8 and kinds.count("validation") == 2
    assert kinds[-1] == "summary"
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == \
        ["ckpt_step0000004.h5", "ckpt_step0000008.h5"]


def test_resume_continues_the_same_trajectory(straight: Path, tmp_path: Path) -> None:
    first = train(tmp_path, "train.max_steps=3", "train.checkpoint_every_steps=3")
    assert first.returncode == 0, first.stderr
    second = train(tmp_path, resume=True)
    assert second.returncode == 0, second.stderr
    assert np.array_equal(losses(tmp_path), losses(straight))


@pytest.mark.parametrize("before,after", [
    ((1, []), (2, ["parallel.depth=2"])),  # 1 rank -> spatial blocks
    ((2, ["parallel.channel=2"]), (1, [])),  # sharded weights and Adam state -> 1 rank
], ids=["N1-to-D2", "C2-to-N1"])
def test_resume_under_another_layout(straight: Path, tmp_path: Path, before, after) -> None:
    """Stop after epoch 1 under one layout, resume under another."""
    first = train(tmp_path, "train.max_steps=4", *before[1], ranks=before[0])
    assert first.returncode == 0, first.stderr
    second = train(tmp_path, *after[1], ranks=after[0], resume=True)
    assert second.returncode == 0, second.stderr
    got, want = losses(tmp_path), losses(straight)
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-4), (got, want)


@pytest.mark.parametrize("extra,message", [
    (["train.batchsize=4"], "did you mean 'train.batch_size'"),
    (["data.source=files", "data.path=/nonexistent/data"], "/nonexistent/data"),
])
def test_bad_input_exits_2(tmp_path: Path, extra: list[str], message: str) -> None:
    done = train(tmp_path, *extra)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_fault_on_one_rank_ends_the_job(tmp_path: Path) -> None:
    started = time.monotonic()
    done = train(tmp_path, "parallel.depth=2", ranks=2, env={"COSMOTRAIN_FAULT": "1:2"},
                 timeout=60)
    assert done.returncode != 0
    assert "fault injected" in done.stderr
    assert time.monotonic() - started < 60
