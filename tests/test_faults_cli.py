"""Fault injection through the CLI under mpiexec: signals, divergence, NaN input.

Each case runs ``cosmotrain train`` end to end (the tiny model on 12^3 synthetic cubes, 2
ranks), injects one fault as a cluster would (a signal to every task or to the launcher,
a learning rate that diverges, a NaN voxel in a data file), and asserts the exit code, the
one-line message, what is on disk, and that the surviving checkpoint resumes to the
uninterrupted run's parameters.  docs/RELIABILITY.md lists the faults and these tests.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, mpiexec, subprocess_env

from cosmotrain.train.checkpoints.checkpoint import list_checkpoints, load_checkpoint

BASE = ["model.name=tiny", "model.width=12", "data.source=synthetic",
        "data.synthetic.samples=40", "data.synthetic.val_fraction=0.1", "train.batch_size=4",
        "optimizer.name=adam", "train.log_every=1", "train.keep_checkpoints=2"]
EXIT_INTERRUPTED, EXIT_NON_FINITE = 75, 3


def command(out: Path, *extra: str, ranks: int = 2, resume: bool = False) -> list[str]:
    sets = [arg for item in [*BASE, f"output.dir={out}", *extra] for arg in ("--set", item)]
    line = [sys.executable, "-m", "cosmotrain", "train", *sets, *(["--resume"] * resume)]
    return [mpiexec(), "-n", str(ranks), *line] if ranks > 1 else line


def train(out: Path, *extra: str, resume: bool = False, timeout: float = 120
          ) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, *extra, resume=resume), cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def final_params(out: Path) -> dict[str, np.ndarray]:
    return load_checkpoint(list_checkpoints(out / "checkpoints")[-1][1]).params


def assert_same_params(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def rank_pids(launcher: subprocess.Popen) -> list[int]:
    """The rank processes under ``mpiexec`` (its grandchildren through hydra's proxy)."""
    found = subprocess.run(["pgrep", "-f", "-P", ",".join(map(str, _descendants(launcher.pid))),
                            "cosmotrain train"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def rank_of(pid: int) -> int:
    """A rank process's MPI rank, from the environment hydra started it with."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(item for item in environ if item.startswith(b"PMI_RANK="))[9:])


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = [int(child) for child in children.stdout.split()]
    return [pid, *[d for child in found for d in _descendants(child)]]


def interrupt(out: Path, signum: int, to_ranks: bool, after_steps: int = 6
              ) -> tuple[subprocess.CompletedProcess, int]:
    """Start a long run, send ``signum`` once ``after_steps`` steps are logged (to every
    rank, as srun does, or to mpiexec, which forwards it); ``(result, steps logged)``."""
    launcher = subprocess.Popen(command(out, "train.epochs=2000"), cwd=REPO,
                                env=subprocess_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 90
    while time.monotonic() < deadline and launcher.poll() is None:
        if metrics.exists() and metrics.read_text().count('"kind":"train"') >= after_steps:
            break
        time.sleep(0.02)
    for pid in rank_pids(launcher) if to_ranks else [launcher.pid]:
        subprocess.run(["kill", f"-{signal.Signals(signum).name[3:]}", str(pid)])
    stdout, stderr = launcher.communicate(timeout=90)
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout,
                                       stderr), after_steps


@pytest.mark.parametrize("signum, to_ranks", [(signal.SIGTERM, True),
                                              (signal.SIGINT, False),
                                              (signal.SIGUSR1, False)])
def test_a_signal_stops_at_a_checkpoint_that_resumes_the_same_run(
        tmp_path: Path, signum: int, to_ranks: bool) -> None:
    out = tmp_path / "run"
    done, logged = interrupt(out, signum, to_ranks)
    assert done.returncode == EXIT_INTERRUPTED, done.stderr[-3000:]
    summary = records(out, "summary")[-1]
    stopped = summary["step"]
    assert summary["stop_reason"] == "interrupted" and stopped >= logged
    assert f"interrupted ({signal.Signals(signum).name} received) after step {stopped}" \
        in done.stdout and "--resume" in done.stdout
    assert list_checkpoints(out / "checkpoints")[-1][0] == stopped
    assert not list((out / "checkpoints").glob("*.tmp"))
    if signum != signal.SIGTERM:
        return
    target = f"train.max_steps={stopped + 5}"
    resumed = train(out, "train.epochs=2000", target, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = train(tmp_path / "straight", "train.epochs=2000", target)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same_params(final_params(out), final_params(tmp_path / "straight"))
    losses = [r["loss"] for r in records(out, "train")]
    assert losses == [r["loss"] for r in records(tmp_path / "straight", "train")]


def test_a_diverging_run_stops_before_saving_a_non_finite_value(tmp_path: Path) -> None:
    out = tmp_path / "diverge"
    done = train(out, "optimizer.name=sgd", "optimizer.lr=1e3", "train.epochs=3",
                 "train.checkpoint_every_steps=1")
    assert done.returncode == EXIT_NON_FINITE, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("cosmotrain:")]
    assert len(errors) == 1 and "went non-finite" in errors[0], done.stderr[-3000:]
    kept = list_checkpoints(out / "checkpoints")
    assert kept, "the good checkpoints before the divergence must survive"
    for step, path in kept:
        state = load_checkpoint(path)
        for name, value in {**state.params, **state.buffers}.items():
            assert np.isfinite(value).all(), f"{path}: {name}"
    last = kept[-1][0]
    straight = train(tmp_path / "straight", "optimizer.name=sgd", "optimizer.lr=1e3",
                     "train.epochs=3", f"train.max_steps={last}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same_params(final_params(out), final_params(tmp_path / "straight"))


def test_a_nan_voxel_in_a_data_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = subprocess.run([sys.executable, "-m", "cosmotrain", "datagen", "--out", str(data),
                           "--samples", "8", "--width", "12", "--dtype", "float32"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    bad = sorted(data.glob("train/*.hdf5"))[1]
    with h5py.File(bad, "r+") as f:
        f["full"][3, 4, 5, 0] = np.nan
    done = train(tmp_path / "run", "data.source=files", f"data.path={data}",
                 "train.epochs=1", "data.synthetic.samples=8")
    assert done.returncode == 2, done.stderr[-3000:]
    assert bad.name in done.stderr and "Traceback" not in done.stderr
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")


def test_a_frozen_rank_ends_the_job_naming_it_and_the_run_resumes(tmp_path: Path) -> None:
    """SIGSTOP on rank 1 (a hung node): the watchdog ends the job with exit 4 naming rank 1
    and its host; the lock it leaves is stale and the run resumes from its checkpoint."""
    out = tmp_path / "run"
    extra = ("train.epochs=2000", "train.watchdog_s=3", "train.checkpoint_every_steps=5")
    launcher = subprocess.Popen(command(out, *extra), cwd=REPO, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 90
    while time.monotonic() < deadline and launcher.poll() is None:
        if metrics.exists() and metrics.read_text().count('"kind":"train"') >= 12:
            break
        time.sleep(0.02)
    ranks = rank_pids(launcher)
    started = time.monotonic()
    try:
        subprocess.run(["kill", "-STOP", str(next(p for p in ranks if rank_of(p) == 1))])
        _, stderr = launcher.communicate(timeout=60)
    finally:
        for pid in ranks:
            subprocess.run(["kill", "-KILL", str(pid)], capture_output=True)
    assert launcher.returncode == 4, stderr[-3000:]
    assert time.monotonic() - started < 30
    named = [line for line in stderr.splitlines() if "watchdog" in line]
    assert len(named) == 1 and "rank 1 (host " in named[0], stderr[-3000:]
    stopped = list_checkpoints(out / "checkpoints")[-1][0]
    target = f"train.max_steps={stopped + 4}"
    resumed = train(out, *extra[:2], target, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stale" in resumed.stdout + resumed.stderr
    straight = train(tmp_path / "straight", *extra[:2], target)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same_params(final_params(out), final_params(tmp_path / "straight"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """An uninterrupted 3-epoch run (9 steps an epoch), a checkpoint after each epoch."""
    out = tmp_path_factory.mktemp("finished") / "run"
    done = train(out, "train.epochs=3", "train.keep_checkpoints=3")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def flip_bytes_inside(path: Path, name: str = "params/fc.weight") -> None:
    """4 KiB of 0xFF over the data of one array, as a failing disk would leave it."""
    with h5py.File(path, "r") as f:
        offset, size = f[name].id.get_offset(), f[name].id.get_storage_size()
    with open(path, "r+b") as raw:
        raw.seek(offset)
        raw.write(b"\xff" * min(4096, size))


def test_a_damaged_checkpoint_is_skipped_on_resume_and_refused_by_predict(
        finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    newest = list_checkpoints(out / "checkpoints")[-1][1]
    with h5py.File(newest, "r") as f:
        name = next(f"params/{key}" for key in f["params"] if f["params"][key].size >= 64)
    flip_bytes_inside(newest, name)
    predicted = subprocess.run(
        [sys.executable, "-m", "cosmotrain", "predict", "--checkpoint", str(newest),
         "--data", str(out / "data"), "--out", str(tmp_path / "p.h5")], cwd=REPO,
        env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert predicted.returncode == 2 and newest.name in predicted.stderr
    assert "Traceback" not in predicted.stderr and not (tmp_path / "p.h5").exists()
    resumed = train(out, "train.epochs=3", "train.keep_checkpoints=3", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"skipped damaged checkpoint {newest}" in said and "resuming from" in said
    assert newest.with_name(newest.name + ".damaged").exists()
    assert_same_params(final_params(out), final_params(finished))


def test_a_fresh_run_into_a_used_directory_is_refused_and_overwrite_keeps_it(
        finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    again = train(out, "train.epochs=1")
    assert again.returncode == 2 and again.stderr.count("cosmotrain: error:") == 1
    assert "already holds a run" in again.stderr and "--overwrite" in again.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    fresh = subprocess.run([*command(out, "train.epochs=1"), "--overwrite"], cwd=REPO,
                           env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    kept = list(out.glob("previous-*/checkpoints"))
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == before


def test_resume_with_a_changed_model_or_batch_is_refused_in_one_line(
        finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    config = (out / "config.yaml").read_text()
    changed = train(out, "train.epochs=4", "train.batch_size=2", "model.dropout=0.5",
                    resume=True)
    assert changed.returncode == 2, changed.stderr[-3000:]
    errors = [line for line in changed.stderr.splitlines() if "cosmotrain: error:" in line]
    assert len(errors) == 1 and "cannot resume" in errors[0]
    assert "train.batch_size (4 -> 2)" in errors[0] and "model.dropout" in errors[0]
    assert (out / "config.yaml").read_text() == config  # nothing was written
    done = train(out, "train.epochs=3", resume=True)
    assert done.returncode == 0 and "already finished at step 27" in done.stdout


def test_a_second_writer_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = subprocess.Popen(command(out, "train.epochs=2000"), cwd=REPO,
                             env=subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = train(out, "train.epochs=2000", resume=True)
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.count("cosmotrain: error:") == 1
        holder = next(p for p in rank_pids(first) if rank_of(p) == 0)  # rank 0 locks
        assert f"is in use by pid {holder} on host" in second.stderr, second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == EXIT_INTERRUPTED
    assert not (out / ".cosmotrain.lock").exists()


def test_kill_9_of_the_writer_during_checkpoints_keeps_a_resumable_run(
        tmp_path: Path) -> None:
    """Rank 0 is killed the moment a checkpoint's temporary file appears (a checkpoint
    every step): what survives is intact and resumes to the uninterrupted parameters."""
    out = tmp_path / "run"
    extra = ("train.epochs=2000", "train.checkpoint_every_steps=1")
    launcher = subprocess.Popen(command(out, *extra), cwd=REPO, env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder, deadline = out / "checkpoints", time.monotonic() + 60
    writer = None
    while time.monotonic() < deadline and launcher.poll() is None:
        names = os.listdir(folder) if folder.is_dir() else []
        if len(names) >= 3 and any(n.endswith(".tmp") for n in names):
            writer = writer or next(p for p in rank_pids(launcher) if rank_of(p) == 0)
            os.kill(writer, signal.SIGKILL)
            break
        if writer is None and len(names) >= 2:
            writer = next(p for p in rank_pids(launcher) if rank_of(p) == 0)
    launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    survived = list_checkpoints(folder)[-1][0]
    target = f"train.max_steps={survived + 3}"
    resumed = train(out, extra[0], target, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list(folder.glob("*.tmp"))
    straight = train(tmp_path / "straight", extra[0], target)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same_params(final_params(out), final_params(tmp_path / "straight"))
