"""Applying mutants to a copy of the repository and running their covering tests.

The working tree is never edited: the repository is copied once per worker into a
temporary directory, each mutant is written into that copy and the copy's original is
written back in a ``finally`` (and the whole copy is removed at the end), so an
interrupted check leaves nothing behind.  Tests run with ``PYTHONDONTWRITEBYTECODE`` in a
copy without ``__pycache__``, so no stale bytecode of a mutant (or of the original) can be
imported after a same-size edit within the same second.  mpi-pytest's forked ``mpiexec``
children inherit the environment and the working directory, so they import the copy too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mutation.catalogue import Mutant

#: what the copy leaves out at the top (VCS data, environments, run outputs and
#: datasets, build products) and everywhere (bytecode, caches)
TOP_IGNORED = {".git", ".venv", "runs", "data", "build", "dist"}
EVERYWHERE_IGNORED = shutil.ignore_patterns("__pycache__", ".pytest_cache", ".mypy_cache",
                                            "*.egg-info")


@dataclass(frozen=True)
class Outcome:
    """How one run of covering tests ended: ``killed``, ``survived`` or ``timeout``
    (a timeout counts as killed: a hang is a failure the suite reports)."""

    mutant: Mutant | None  # None: the baseline run of the unmutated copy
    verdict: str
    seconds: float
    tail: str  # the last lines of pytest's output, for a survivor's or a failure's report

    @property
    def killed(self) -> bool:
        return self.verdict in ("killed", "timeout")


@contextmanager
def repository_copy(root: Path) -> Iterator[Path]:
    """A throw-away copy of the repository at ``root`` (removed on exit)."""
    parent = Path(tempfile.mkdtemp(prefix="cosmotrain-mutation-"))
    try:
        copy = parent / "repo"
        def ignored(folder: str, names: list[str]) -> set[str]:
            top = TOP_IGNORED if Path(folder) == root else set()
            return top & set(names) | EVERYWHERE_IGNORED(folder, names)

        shutil.copytree(root, copy, ignore=ignored, symlinks=True)
        yield copy
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, str]:
    """Run ``tests`` in ``copy``; (``passed`` | ``failed`` | ``timeout``, output tail).
    The process group (mpiexec and its ranks with it) is killed on a timeout, and on
    anything that interrupts the wait (Ctrl-C, SIGTERM: see ``__main__``)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1",
           # mpi-pytest calls the mpiexec on PATH: the environment's own (mpich wheel) first
           "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                    os.environ.get("PATH", "")])}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               "--no-header", "-o", "addopts=", *tests]
    proc = subprocess.Popen(command, cwd=copy, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _LIVE.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        return "timeout", _tail(output)
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        _LIVE.discard(proc)
    return ("passed" if proc.returncode == 0 else "failed"), _tail(output)


#: the test runs in progress (one per worker), killed when the check is interrupted
_LIVE: set[subprocess.Popen] = set()


def _kill_live() -> None:
    for proc in list(_LIVE):
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group has ended already
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(output: str, lines: int = 12) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])


def run_mutant(copy: Path, mutant: Mutant, timeout: float) -> Outcome:
    """Apply ``mutant`` to ``copy``, run its tests, restore the file whatever happens."""
    target = copy / mutant.file
    original = target.read_text(encoding="utf-8")
    start = time.perf_counter()
    try:
        target.write_text(mutant.apply(original), encoding="utf-8")
        status, tail = run_tests(copy, mutant.tests, timeout)
    finally:
        target.write_text(original, encoding="utf-8")
    verdict = {"passed": "survived", "failed": "killed"}.get(status, status)
    return Outcome(mutant, verdict, time.perf_counter() - start, tail)


#: a mutant's tests may run this many times as long as the unmutated ones did (and at
#: least TIMEOUT_FLOOR_S): a mutant that makes a parallel test hang (a message never
#: sent) is then a kill after seconds, not after the suite's 10-minute safety net
TIMEOUT_FACTOR = 8.0
TIMEOUT_FLOOR_S = 30.0


def baseline(copy: Path, mutants: list[Mutant], timeout: float
             ) -> tuple[list[Outcome], dict[tuple[str, ...], float]]:
    """Run every distinct test selection once, unmutated: all must pass, or a failing
    test would count as a kill.  The failures (empty when the baseline is sound) and
    each selection's timeout for its mutants (``TIMEOUT_FACTOR`` x its time, at most
    ``timeout``)."""
    failures, limits = [], {}
    for tests in dict.fromkeys(m.tests for m in mutants):
        start = time.perf_counter()
        status, tail = run_tests(copy, tests, timeout)
        seconds = time.perf_counter() - start
        limits[tests] = min(timeout, max(TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * seconds))
        if status != "passed":
            failures.append(Outcome(None, f"baseline {status}: {' '.join(tests)}",
                                    seconds, tail))
    return failures, limits


def run_all(root: Path, mutants: list[Mutant], timeout: float, jobs: int,
            report: Callable[[Outcome], None], check_baseline: bool = True
            ) -> tuple[list[Outcome], list[Outcome]]:
    """(baseline failures, outcomes of every mutant in catalogue order).  ``jobs``
    workers, each with its own copy; nothing runs when the baseline fails."""
    from concurrent.futures import ThreadPoolExecutor

    limits: dict[tuple[str, ...], float] = {}
    with repository_copy(root) as first:
        if check_baseline:
            failures, limits = baseline(first, mutants, timeout)
            if failures:
                return failures, []
        copies = [first]
        with _more_copies(root, jobs - 1) as extra:
            copies += extra
            free = list(copies)

            def work(mutant: Mutant) -> Outcome:
                copy = free.pop()
                try:
                    outcome = run_mutant(copy, mutant, limits.get(mutant.tests, timeout))
                finally:
                    free.append(copy)
                report(outcome)
                return outcome

            if len(copies) == 1:
                return [], [work(mutant) for mutant in mutants]
            pool = ThreadPoolExecutor(max_workers=len(copies))
            try:
                return [], list(pool.map(work, mutants))
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                _kill_live()
                raise
            finally:
                pool.shutdown(wait=True)


@contextmanager
def _more_copies(root: Path, count: int) -> Iterator[list[Path]]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        yield [stack.enter_context(repository_copy(root)) for _ in range(max(count, 0))]
