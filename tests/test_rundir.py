"""Run-directory safety: the output.dir lock and the fresh / resume / overwrite check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cosmotrain.errors import UserError
from cosmotrain.files import run_lock as rundir
from cosmotrain.train.run_outputs import check_fresh_directory
from cosmotrain.files.run_lock import (LOCK_NAME, LocalProcesses, LockHolder, RunDirError,
                                        RunLock, this_process)

HOST = "node-a"
STARTED = time.mktime((2026, 11, 23, 15, 2, 0, 0, 0, -1))


class FakeProbe:
    """This host's processes as a test says they are: pid -> start time."""

    def __init__(self, running: dict[int, int | None] | None = None) -> None:
        self.running = running or {}

    def alive(self, pid: int) -> bool:
        return pid in self.running

    def start_time(self, pid: int) -> int | None:
        return self.running.get(pid)


def holder(pid: int, host: str = HOST, proc_start: int | None = 100,
           job_id: str | None = None) -> LockHolder:
    return LockHolder(host=host, pid=pid, started=STARTED, argv=("cosmotrain", "train"),
                      job_id=job_id, proc_start=proc_start)


def lock(out: Path, pid: int, probe: FakeProbe, **kw: object) -> RunLock:
    return RunLock(out, holder(pid, **kw), probe=probe)  # type: ignore[arg-type]


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "x"
    probe = FakeProbe({1234: 100})
    run = lock(out, 1234, probe, job_id="77")
    assert run.acquire() is None
    record = json.loads((out / LOCK_NAME).read_text())
    assert record["host"] == HOST and record["pid"] == 1234 and record["job_id"] == "77"
    assert record["started_epoch"] == STARTED
    assert record["started"].startswith("2026-11-23T15:02:00")
    assert record["command"] == "cosmotrain train" and record["argv"] == ["cosmotrain", "train"]
    assert run.release() is True
    assert not (out / LOCK_NAME).exists()
    assert run.release() is False  # released once only


def test_context_manager_releases_on_error(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        with lock(tmp_path, 1234, FakeProbe({1234: 100})):
            assert (tmp_path / LOCK_NAME).exists()
            raise KeyError("boom")
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_second_writer_is_refused_with_a_line_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "x"
    probe = FakeProbe({1234: 100, 999: 5})
    first = lock(out, 1234, probe, job_id="77")
    first.acquire()
    with pytest.raises(RunDirError) as err:
        lock(out, 999, probe).acquire()
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    assert message == (f"output.dir '{out}' is in use by pid 1234 on host {HOST} (Slurm job 77) "
                       f"since 2026-11-23 15:02 (lock .cosmotrain.lock); wait for it, or "
                       f"choose another output.dir")
    assert first.release()
    assert lock(out, 999, probe).acquire() is None  # free again


def test_the_same_process_twice_is_refused(tmp_path: Path) -> None:
    probe = FakeProbe({1234: 100})
    lock(tmp_path, 1234, probe).acquire()
    with pytest.raises(RunDirError, match="this process holds it already"):
        lock(tmp_path, 1234, probe).acquire()


def test_a_stale_lock_of_a_dead_pid_is_replaced(tmp_path: Path) -> None:
    probe = FakeProbe({999: 5})  # 1234 is not running
    lock(tmp_path, 1234, probe).acquire()  # and never released: its process died
    run = lock(tmp_path, 999, probe)
    stale = run.acquire()
    assert stale is not None and stale.holder.pid == 1234
    assert stale.reason == "pid 1234 is not running"
    assert stale.note().startswith(f"cosmotrain: replaced the stale lock {tmp_path / LOCK_NAME}"
                                   f" of pid 1234 on host {HOST} since 2026-11-23 15:02")
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == 999
    assert not list(tmp_path.glob(LOCK_NAME + ".*"))  # no temporary or guard file left
    assert run.replaced is stale and run.release()
    lock(tmp_path, 1234, probe).acquire()  # dies again
    with lock(tmp_path, 999, probe) as held:  # the note reaches context-manager users
        assert held.replaced is not None and held.replaced.holder.pid == 1234


def test_a_reused_pid_is_recognised_by_its_start_time(tmp_path: Path) -> None:
    lock(tmp_path, 1234, FakeProbe({1234: 100})).acquire()
    probe = FakeProbe({1234: 555, 999: 5})  # pid 1234 runs again, started later
    stale = lock(tmp_path, 999, probe).acquire()
    assert stale is not None and stale.reason == "pid 1234 is now another process"


def test_a_live_pid_without_a_recorded_start_time_is_trusted(tmp_path: Path) -> None:
    lock(tmp_path, 1234, FakeProbe({1234: None}), proc_start=None).acquire()
    with pytest.raises(RunDirError, match="in use by pid 1234"):
        lock(tmp_path, 999, FakeProbe({1234: 555, 999: 5})).acquire()


def test_another_host_is_refused_with_the_command_that_removes_its_lock(tmp_path: Path
                                                                         ) -> None:
    lock(tmp_path, 1234, FakeProbe(), host="node-b").acquire()
    with pytest.raises(RunDirError) as err:
        lock(tmp_path, 999, FakeProbe({999: 5})).acquire()  # 1234 not running *here*
    message = str(err.value)
    assert "in use by pid 1234 on host node-b since 2026-11-23 15:02" in message
    assert f"(rm {tmp_path / LOCK_NAME})" in message and "\n" not in message


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path: Path) -> None:
    first = lock(tmp_path, 1234, FakeProbe({1234: 100}))
    first.acquire()
    second = lock(tmp_path, 999, FakeProbe({999: 5}))  # judges 1234 dead
    assert second.acquire() is not None
    assert first.release() is False
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == 999


def test_a_damaged_lock_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rundir, "READ_PATIENCE_S", 0.1)
    (tmp_path / LOCK_NAME).write_text("")  # a writer died between create and write
    with pytest.raises(RunDirError, match=r"not a cosmotrain lock or is damaged.*\(rm "):
        lock(tmp_path, 999, FakeProbe({999: 5})).acquire()


def test_racing_writers_get_one_lock(tmp_path: Path) -> None:
    """Eight jobs start at once on one directory (with a stale lock in it): one wins."""
    lock(tmp_path, 1, FakeProbe({1: 100})).acquire()  # pid 1 is dead in the probe below
    pids = list(range(100, 108))
    probe = FakeProbe({pid: 100 for pid in pids})  # as they record it
    results: dict[int, str] = {}
    barrier = threading.Barrier(len(pids))

    def start(pid: int) -> None:
        run = lock(tmp_path, pid, probe)
        barrier.wait()
        try:
            run.acquire()
            results[pid] = "won"
        except RunDirError as err:
            results[pid] = str(err)

    threads = [threading.Thread(target=start, args=(pid,)) for pid in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [pid for pid, result in results.items() if result == "won"]
    assert len(winners) == 1, results
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == winners[0]
    assert all(f"in use by pid {winners[0]}" in r for p, r in results.items() if p != winners[0])


def test_real_processes_dead_and_alive(tmp_path: Path) -> None:
    """The default probe: a finished child is dead, a running one is alive."""
    me = this_process(job_id="42", argv=["cosmotrain", "train"])
    assert me.pid == os.getpid() and me.job_id == "42" and me.argv == ("cosmotrain", "train")
    probe = LocalProcesses()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert not probe.alive(done.pid)
    RunLock(tmp_path, LockHolder(me.host, done.pid, time.time(),
                                 proc_start=me.proc_start)).acquire()
    assert RunLock(tmp_path, me).acquire() is not None  # stale: replaced
    (tmp_path / LOCK_NAME).unlink()

    spawned = time.time()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert probe.alive(alive.pid)
        started = probe.start_time(alive.pid)
        if started is not None:  # clock ticks after boot: the moment the child was made
            boot = next(int(line.split()[1]) for line in
                        Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
            assert abs(boot + started / os.sysconf("SC_CLK_TCK") - spawned) < 5
        RunLock(tmp_path, LockHolder(me.host, alive.pid, time.time(),
                                     proc_start=probe.start_time(alive.pid))).acquire()
        with pytest.raises(RunDirError, match=f"in use by pid {alive.pid}"):
            RunLock(tmp_path, me).acquire()
        if probe.start_time(alive.pid) is not None:  # /proc: a reused pid is told apart
            (tmp_path / LOCK_NAME).unlink()
            RunLock(tmp_path, LockHolder(me.host, alive.pid, time.time(),
                                         proc_start=-1)).acquire()
            stale = RunLock(tmp_path, me).acquire()
            assert stale is not None and "another process" in stale.reason
    finally:
        alive.kill()
        alive.wait()


# ------------------------------------------------------------ fresh / resume / overwrite


def make_run(out: Path, checkpoints: int = 2) -> None:
    (out / "checkpoints").mkdir(parents=True)
    for step in range(1, checkpoints + 1):
        (out / "checkpoints" / f"ckpt_step{step * 20:07d}.h5").write_bytes(b"h5")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "config.yaml").write_text("model: {width: 64}\n")
    (out / "data").mkdir()
    (out / "data" / "manifest.json").write_text("{}")


@pytest.mark.parametrize("mode", ["fresh", "resume", "overwrite"])
def test_an_empty_or_missing_directory_is_fine(tmp_path: Path, mode: str) -> None:
    assert check_fresh_directory(tmp_path / "new", mode) is None
    assert check_fresh_directory(tmp_path, mode) is None


def test_config_and_data_alone_are_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")  # truncated at start, nothing written
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt_step0000001.h5.tmp").write_bytes(b"")
    assert check_fresh_directory(tmp_path, "fresh") is None
    assert check_fresh_directory(tmp_path, "overwrite") is None
    assert (tmp_path / "config.yaml").exists() and not list(tmp_path.glob("previous-*"))


def test_fresh_refuses_another_runs_outputs(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "x"
    make_run(out, checkpoints=3)
    with pytest.raises(RunDirError) as err:
        check_fresh_directory(out, "fresh")
    assert str(err.value) == (f"output.dir '{out}' already holds a run (3 checkpoints, "
                              f"metrics.jsonl); continue it with --resume, start over with "
                              f"--overwrite, or choose another output.dir")
    (out / "metrics.jsonl").unlink()
    with pytest.raises(RunDirError, match=r"already holds a run \(3 checkpoints\)"):
        check_fresh_directory(out, "fresh")


def test_resume_accepts_anything(tmp_path: Path) -> None:
    make_run(tmp_path)
    assert check_fresh_directory(tmp_path, "resume") is None
    assert (tmp_path / "metrics.jsonl").exists()


def test_overwrite_moves_the_previous_run_aside(tmp_path: Path) -> None:
    make_run(tmp_path)
    now = time.mktime((2026, 11, 23, 15, 2, 11, 0, 0, -1))
    moved = check_fresh_directory(tmp_path, "overwrite", now=now)
    assert moved is not None
    assert moved.dest == tmp_path / "previous-20261123-150211"
    assert moved.names == ("checkpoints/", "metrics.jsonl", "config.yaml")
    assert moved.note() == (f"cosmotrain: moved the previous run's outputs (checkpoints/, "
                            f"metrics.jsonl, config.yaml) to {moved.dest}/")
    kept = moved.dest
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == \
        ["ckpt_step0000020.h5", "ckpt_step0000040.h5"]
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (kept / "config.yaml").exists()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / "data" / "manifest.json").exists()  # the dataset stays
    assert check_fresh_directory(tmp_path, "fresh") is None  # now clean

    (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n')  # a second run, same second
    again = check_fresh_directory(tmp_path, "overwrite", now=now)
    assert again is not None and again.dest == tmp_path / "previous-20261123-150211-2"
    assert again.names == ("metrics.jsonl",)
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_overwrite_moves_the_mlperf_log_aside_and_keeps_the_new_staging_lines(
        tmp_path: Path) -> None:
    """The previous run's mlperf.log goes aside whole; the staging lines a preload wrote
    at its end, for the run about to start, stay in output.dir."""
    make_run(tmp_path)
    staging = (':::MLLOG {"key": "staging_start", "value": null}\n'
               ':::MLLOG {"key": "staging_stop", "value": null}\n')
    previous = (':::MLLOG {"key": "run_start", "value": null}\n'
                ':::MLLOG {"key": "run_stop", "value": null}\n')
    (tmp_path / "mlperf.log").write_text(previous + staging)
    moved = check_fresh_directory(tmp_path, "overwrite", now=0.0)
    assert moved is not None and moved.names[-1] == "mlperf.log"
    assert (moved.dest / "mlperf.log").read_text() == previous + staging
    assert (tmp_path / "mlperf.log").read_text() == staging

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # a log with no staging tail
    (tmp_path / "mlperf.log").write_text(previous)
    again = check_fresh_directory(tmp_path, "overwrite", now=0.0)
    assert (again.dest / "mlperf.log").read_text() == previous
    assert not (tmp_path / "mlperf.log").exists()


def test_an_unknown_mode_is_a_bug(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        check_fresh_directory(tmp_path, "append")



def test_an_output_dir_that_cannot_be_created_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match=r"output.dir '.*' cannot be created .*; choose"):
        lock(tmp_path / "file" / "x", 999, FakeProbe({999: 5})).acquire()


def test_a_zombie_holds_no_lock(tmp_path: Path) -> None:
    """An aborted MPI rank is a zombie for a moment after mpiexec returns: its lock is
    stale at once, so a --resume right after the abort is not refused."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert not LocalProcesses().alive(child.pid)
    finally:
        child.wait()
