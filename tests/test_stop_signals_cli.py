"""Stop signals from the first second, through the CLI (docs/RELIABILITY.md).

- A SIGTERM (to every rank, as srun sends it) or a SIGUSR1 (to mpiexec, which forwards it;
  MPICH's own handler in each rank used to drop it) during start-up ends the 2-rank job
  with exit 75 and nothing written half, and the same command then runs to its end.
- A signal during the preload pass does the same (in-process: the pass is too short to
  hit from outside, so the signal is raised from inside it).
- A second Ctrl-C during a checkpoint write ends every rank within seconds with exit 130
  and one line; the checkpoints on disk are whole, as before the write or with it.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env
from test_faults_cli import EXIT_INTERRUPTED, command, rank_pids, records, train

from cosmotrain.data.formats import interface as formats
from cosmotrain.train.checkpoints.checkpoint import list_checkpoints, load_checkpoint

SLOW_START = "data.synthetic.samples=400"  # about 2 s of data generation at start-up
EXIT_KEYBOARD = 130


def wait_for_line(job: subprocess.Popen, text: str, timeout: float = 60) -> None:
    """Read the job's stdout until a line holds ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = job.stdout.readline()
        if text in line:
            return
        if not line and job.poll() is not None:
            break
    job.kill()
    pytest.fail(f"the job never printed {text!r}")


def assert_nothing_half_written(out: Path) -> None:
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    for _, path in list_checkpoints(out / "checkpoints"):
        load_checkpoint(path)  # whole: every checksum holds


@pytest.mark.parametrize("signum, to_ranks", [(signal.SIGTERM, True),
                                              (signal.SIGUSR1, False)])
def test_a_signal_during_start_up_ends_the_job_with_75_and_a_rerun_completes(
        tmp_path: Path, signum: int, to_ranks: bool) -> None:
    out = tmp_path / "run"
    job = subprocess.Popen(command(out, SLOW_START, "train.max_steps=3"), cwd=REPO,
                           env=subprocess_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    wait_for_line(job, "cosmotrain: outputs in")  # claimed; the job is being built
    time.sleep(0.3)
    for pid in rank_pids(job) if to_ranks else [job.pid]:
        subprocess.run(["kill", f"-{signal.Signals(signum).name[3:]}", str(pid)])
    _, err = job.communicate(timeout=60)
    assert job.returncode == EXIT_INTERRUPTED, err[-3000:]
    name = signal.Signals(signum).name
    assert err.count(f"stopped: {name} received during start-up") == 1, err[-3000:]
    assert "Traceback" not in err
    assert not list_checkpoints(out / "checkpoints") and not (out / "config.yaml").exists()
    assert_nothing_half_written(out)
    again = train(out, SLOW_START, "train.max_steps=3")  # what train.sbatch's requeue runs
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in records(out, "train")] == [1, 2, 3]


def test_a_signal_during_the_preload_pass_ends_the_job_with_75(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = cli("datagen", "--out", str(tmp_path / "d"), "--samples", "12",
                       "--width", "8")
    assert code == 0, err
    read_block, reads = formats.read_block, []

    def read_and_signal(*args, **kwargs):
        reads.append(args[0])
        if len(reads) == 3:  # the preload pass is under way
            signal.raise_signal(signal.SIGUSR1)
        return read_block(*args, **kwargs)
    monkeypatch.setattr(formats, "read_block", read_and_signal)
    kept = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        code, _, err = cli("train", "--set", "model.name=tiny", "--set", "model.width=8",
                           "--set", f"data.path={tmp_path / 'd'}", "--set",
                           "train.batch_size=2", "--set", f"output.dir={tmp_path / 'run'}")
    finally:
        for number, handler in kept.items():  # the CLI ignores them once it stops
            signal.signal(number, handler)
    assert code == EXIT_INTERRUPTED, err
    assert err.count("stopped: SIGUSR1 received during start-up") == 1
    assert len(reads) == 3  # stopped inside the pass, at the read that met the signal
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")
    assert_nothing_half_written(tmp_path / "run")


def test_a_second_ctrl_c_during_a_checkpoint_write_ends_every_rank_with_130(
        tmp_path: Path) -> None:
    """The paper network at 16^3 (9.4M parameters and Adam's state: a 113 MB checkpoint)
    so that a write lasts long enough to be caught: once its temporary file appears the
    ranks are frozen, sent the second SIGINT, and let go."""
    out = tmp_path / "run"
    job = subprocess.Popen(command(out, "model.name=cosmoflow", "model.width=16",
                                   "train.batch_size=2", "train.epochs=2000",
                                   "train.checkpoint_every_steps=4"),
                           cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    folder, deadline = out / "checkpoints", time.monotonic() + 120
    while time.monotonic() < deadline and job.poll() is None:
        if folder.is_dir() and list_checkpoints(folder):
            break
        time.sleep(0.05)
    ranks = rank_pids(job)
    for pid in ranks:  # the first Ctrl-C: stop at the next step, with a checkpoint
        subprocess.run(["kill", "-INT", str(pid)])
    caught = False
    while not caught and time.monotonic() < deadline and job.poll() is None:
        caught = any(p.name.endswith(".tmp") for p in folder.iterdir())
        time.sleep(0.001)
    assert caught, "no checkpoint write was seen after the first Ctrl-C"
    for kind in ("STOP", "INT", "CONT"):  # the second one, while the write is in flight
        for pid in ranks:
            subprocess.run(["kill", f"-{kind}", str(pid)])
    sent = time.monotonic()
    _, err = job.communicate(timeout=60)
    assert job.returncode == EXIT_KEYBOARD, err[-3000:]
    assert time.monotonic() - sent < 20  # every rank ended, none waits in a collective
    assert err.count("interrupted again (a second SIGINT)") == 1, err[-3000:]
    assert list_checkpoints(folder)  # the earlier checkpoint is still there, whole
    assert_nothing_half_written(out)


def test_a_signal_during_preload_ends_it_with_75_and_the_same_preload_completes(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cosmotrain preload`` takes the stop signals too (Slurm's SIGTERM or SIGUSR1 while
    a job stages): exit 75, one line, the stage refused as unfinished by ``train``, and
    the same command then completes it."""
    from cosmotrain.data.copies import stage as staging

    data, dest = tmp_path / "d", tmp_path / "stage"
    code, _, err = cli("datagen", "--out", str(data), "--samples", "8", "--width", "8")
    assert code == 0, err
    copy, copies = staging._copy, []

    def copy_and_signal(source: Path, target: Path) -> int:
        copies.append(source)
        if len(copies) == 3:  # the staging is under way
            signal.raise_signal(signal.SIGTERM)
        return copy(source, target)
    monkeypatch.setattr(staging, "_copy", copy_and_signal)
    args = ["preload", "--set", f"data.path={data}", "--set", "model.width=8",
            "--set", "train.batch_size=4", "--dest", str(dest)]
    kept = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        code, _, err = cli(*args)
    finally:
        for number, handler in kept.items():  # the CLI ignores them once it stops
            signal.signal(number, handler)
    assert code == EXIT_INTERRUPTED, err
    assert err.count("stopped: SIGTERM received during staging") == 1
    assert len(copies) == 3 and not (dest / "manifest.json").exists()
    code, _, err = cli("train", "--config", str(REPO / "configs/tiny.yaml"), "--set",
                       "data.source=files", "--set", f"data.path={dest}", "--set",
                       "model.width=8", "--set", "train.batch_size=4", "--set",
                       f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "unfinished staging" in err, err
    monkeypatch.setattr(staging, "_copy", copy)
    code, out, err = cli(*args)
    assert code == 0 and (dest / "manifest.json").is_file(), err
