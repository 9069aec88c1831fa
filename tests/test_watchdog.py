"""The watchdog: its deadline rule and verdicts (pure), and whole jobs under mpiexec in which
a rank freezes (SIGSTOP), deadlocks or is merely slow inside an allowed phase."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, mpiexec, subprocess_env
from cosmotrain.comm.watchdog_verdict import (
    INTERVAL_FACTOR,
    MAX_NAMED,
    Report,
    Verdict,
    deadline_s,
    default_grace_s,
    default_poll_s,
    describe,
    judge,
    name_ranks,
)
from cosmotrain.errors import EXIT_WATCHDOG

# -- the deadline rule and the verdicts: pure, no MPI --------------------------------------


@pytest.mark.parametrize("timeout, slowest, allowance, expected", [
    (300.0, 0.0, 0.0, 300.0),  # no beat interval seen yet: the timeout
    (300.0, 12.0, 0.0, 300.0),  # short steps: the timeout
    (300.0, 45.0, 0.0, 450.0),  # a slow machine's 45 s steps: 10 x the slowest interval
    (300.0, 45.0, 600.0, 1050.0),  # inside allow(600): longer by the allowance
    (2.0, 0.1, 0.0, 2.0),
])
def test_deadline_rule(timeout: float, slowest: float, allowance: float,
                       expected: float) -> None:
    assert INTERVAL_FACTOR == 10.0
    assert deadline_s(timeout, slowest, allowance) == pytest.approx(expected)


def test_deadline_factor_is_a_parameter() -> None:
    assert deadline_s(10.0, 3.0, factor=2.0) == 10.0
    assert deadline_s(10.0, 7.0, factor=2.0) == 14.0


def test_grace_and_poll_follow_the_timeout_within_bounds() -> None:
    assert default_grace_s(2.0) == 2.0 and default_grace_s(300.0) == 15.0
    assert default_grace_s(60.0) == pytest.approx(6.0)
    assert default_poll_s(2.0) == pytest.approx(0.1) and default_poll_s(300.0) == 1.0
    assert default_poll_s(0.1) == 0.05


STALLED = Report(step=5, stalled=True, idle_s=300.0, remaining_s=-1.0)
BUSY = Report(step=5, stalled=False, idle_s=100.0, remaining_s=500.0)


def test_a_silent_rank_is_the_suspect() -> None:
    verdict = judge(0, [1, 2, 3], {2: STALLED, 3: BUSY}, departed=[], grace_s=5.0)
    assert verdict == Verdict("abort", suspects=(1,), printer=0)
    # rank 0 is frozen: rank 2 is the lowest stalled rank it knows of, so it prints
    assert judge(2, [0, 1, 3], {1: STALLED}, [], 5.0) == Verdict("abort", (0, 3), printer=1)


def test_a_rank_within_its_deadline_makes_the_others_wait() -> None:
    verdict = judge(1, [0, 2], {0: BUSY, 2: STALLED}, [], grace_s=5.0)
    assert verdict == Verdict("wait", rearm_s=500.0)
    soon = BUSY._replace(remaining_s=0.5)
    assert judge(1, [0, 2], {0: soon, 2: STALLED}, [], grace_s=5.0).rearm_s == 5.0


def test_all_ranks_stalled_is_a_deadlock_and_a_stopped_rank_is_no_suspect() -> None:
    assert judge(2, [0, 1], {0: STALLED, 1: STALLED}, [], 5.0) == Verdict("abort", (), 0)
    assert judge(2, [0, 1], {1: STALLED}, [0], 5.0) == Verdict("abort", (), 1)


def test_messages_name_ranks_and_hosts() -> None:
    hosts = ["nid0010", "nid0011", "nid0012", "nid0012"]
    me = Report(5, True, 301.4, -1.4)
    line = describe(Verdict("abort", (2,), 0), 0, me, {1: STALLED, 3: STALLED}, [], hosts)
    assert line == ("watchdog: rank 2 (host nid0012) made no progress and does not respond; "
                    "the other ranks waited 301 s for it (last step 5); ending the job")
    two = describe(Verdict("abort", (2, 3), 0), 0, me, {1: STALLED}, [], hosts)
    assert "ranks 2 (host nid0012), 3 (host nid0012) made no progress and do not" in two
    behind = STALLED._replace(step=4)
    dead = describe(Verdict("abort", (), 0), 0, me, {1: behind, 2: STALLED}, [3], hosts)
    assert "deadlock" in dead
    assert ("(last step 4 on rank 1 (host nid0011); last step 5 on ranks 0 (host nid0010), "
            "2 (host nid0012); rank 3 (host nid0012) already stopped)") in dead
    many = name_ranks(list(range(MAX_NAMED + 3)), ["h"] * (MAX_NAMED + 3))
    assert many.endswith(f"{MAX_NAMED - 1} (host h) and 3 more")


# -- beat, allow, report and stop in this process (one rank, no thread firing) -------------


def test_beat_records_the_slowest_step_interval_but_not_allowed_phases() -> None:
    from mpi4py import MPI

    from cosmotrain.comm.watchdog import Watchdog

    dog = Watchdog(MPI.COMM_SELF, timeout_s=0.01, interval_factor=1.0)
    assert not dog.threaded and dog.hosts == (MPI.Get_processor_name(),)
    dog.beat(0)
    time.sleep(0.05)
    dog.beat(1)
    slowest = dog._slowest  # noqa: SLF001
    assert slowest >= 0.05 and dog.report().step == 1
    assert not dog.report().stalled  # 0.05 s since the last beat is within 1 x 0.05 s
    with dog.allow(30.0):
        assert dog.report().remaining_s > 29.0
        time.sleep(0.1)
        dog.beat(2)
    assert dog._slowest == slowest and dog._allow_s == 0.0  # noqa: SLF001
    time.sleep(0.1)
    assert dog.report().stalled and dog.report().idle_s >= 0.1
    dog.stop()
    dog.stop()  # twice is fine, and so is a watchdog that never started
    with pytest.raises(ValueError, match="positive"):
        Watchdog(MPI.COMM_SELF, timeout_s=0.0)


# -- whole jobs ------------------------------------------------------------------------------

SCRIPT = r'''
import os, signal, sys, time
from pathlib import Path
import mpi4py
mode, out = sys.argv[1], Path(sys.argv[2])
if mode == "funneled":
    mpi4py.rc.thread_level = "funneled"
from mpi4py import MPI
from cosmotrain.comm.watchdog import Watchdog
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
(out / f"rank{rank}").write_text(f"{os.getpid()} {MPI.Get_processor_name()}")
dog = Watchdog(comm, timeout_s=2.0).start()
for step in range(12):
    if mode in ("freeze", "funneled") and rank == 1 and step == 3:
        (out / "frozen_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "deadlock" and rank == 2 and step == 3:
        comm.recv(source=0, tag=99)  # never sent
    if mode == "healthy" and rank == 0 and step == 3:
        with dog.allow(4.0):  # rank 0 is slow (a checkpoint): the others wait, no alarm
            time.sleep(3.0)
    if mode == "alone" and step == 3:
        time.sleep(30)  # a hung single process
    if mode == "stopped" and step == 3:
        dog.stop()
        time.sleep(3)  # past the deadline: a stopped watchdog never fires
    comm.Barrier()
    time.sleep(0.02)
    dog.beat(step)
dog.stop()
'''


@pytest.fixture
def job(tmp_path: Path) -> Iterator:
    """Run SCRIPT under mpiexec; afterwards kill any rank that is still there."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    launched: list[subprocess.Popen] = []

    def run(mode: str, ranks: int) -> tuple[subprocess.CompletedProcess, float]:
        command = [mpiexec(), "-n", str(ranks), sys.executable, str(script), mode,
                   str(tmp_path)]
        env = {**subprocess_env(), "PYTHONPATH": str(REPO),
               "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
        start = time.time()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        launched.append(proc)
        out, err = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(command, proc.returncode, out, err), start

    yield run
    for proc in launched:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in rank_pids(tmp_path):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def rank_pids(out: Path) -> list[int]:
    return [int(p.read_text().split()[0]) for p in sorted(out.glob("rank*"))]


def host_of(out: Path, rank: int) -> str:
    return (out / f"rank{rank}").read_text().split()[1]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def test_a_frozen_rank_ends_the_job_naming_it(job, tmp_path: Path) -> None:
    done, _ = job("freeze", 3)
    ended = time.time()
    assert done.returncode == EXIT_WATCHDOG, done.stderr
    frozen_at = float((tmp_path / "frozen_at").read_text())
    # deadline 2 s + grace 2 s + polling and the abort: well within 20 s
    assert ended - frozen_at < 20.0, done.stderr
    named = f"rank 1 (host {host_of(tmp_path, 1)})"
    assert done.stderr.count(named) == 1, done.stderr
    assert done.stderr.count("cosmotrain: error: watchdog:") == 1, done.stderr
    assert "made no progress and does not respond" in done.stderr
    assert wait_gone(rank_pids(tmp_path)) == []  # the stopped rank was killed too


def test_a_healthy_job_with_a_slow_allowed_phase_runs_to_the_end(job) -> None:
    done, _ = job("healthy", 3)
    assert done.returncode == 0, done.stderr
    assert "watchdog" not in done.stderr


def test_a_deadlock_where_every_rank_responds_ends_the_job(job, tmp_path: Path) -> None:
    done, _ = job("deadlock", 3)
    assert done.returncode == EXIT_WATCHDOG, done.stderr
    assert done.stderr.count("cosmotrain: error: watchdog:") == 1, done.stderr
    assert "a deadlock or a hung collective (last step 2 on ranks 0 (host" in done.stderr
    assert wait_gone(rank_pids(tmp_path)) == []


def test_without_thread_multiple_each_waiting_rank_reports_itself(job, tmp_path) -> None:
    done, _ = job("funneled", 3)
    assert done.returncode == EXIT_WATCHDOG, done.stderr
    assert "cannot tell which" in done.stderr and "rank 1 (host" not in done.stderr
    assert wait_gone(rank_pids(tmp_path)) == []


def test_a_single_hung_process_is_ended(job, tmp_path: Path) -> None:
    done, start = job("alone", 1)
    assert done.returncode == EXIT_WATCHDOG, done.stderr
    assert time.time() - start < 20.0
    host = host_of(tmp_path, 0)
    line = (rf"cosmotrain: error: watchdog: rank 0 \(host {re.escape(host)}\) made no "
            r"progress for \d+ s \(last step 2\); ending the job\n")
    assert re.search(line, done.stderr), done.stderr


def test_a_stopped_watchdog_never_fires(job) -> None:
    done, _ = job("stopped", 1)
    assert done.returncode == 0, done.stderr
    assert "watchdog" not in done.stderr
