"""Shared test helpers: run the CLI in-process and find the environment's mpiexec."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Settings the ranks of the parallel tests inherit (mpi-pytest launches mpiexec).

    Up to 8 ranks share CI's 2 cores: one BLAS thread each, and MPICH yields the core
    while it waits instead of spinning (a spinning rank starves the ranks it waits for).
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel) or on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("mpiexec not found: pip install -e '.[test]' installs the mpich wheel")
    return found


def cuda_devices() -> int:
    """How many CUDA devices cupy sees (0 without cupy, a driver or a device)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: none usable
        return 0


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: the venv's bin first, one BLAS thread per rank."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> Callable[..., tuple[int, str, str]]:
    """``cli("config", "--set", "x=1") -> (exit code, stdout, stderr)``, in-process."""
    from cosmotrain.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["cosmotrain", *args])
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def abort_on_error(test: Callable[..., None]) -> Callable[..., None]:
    """Run an MPI test body so that an exception on one rank ends the whole job.

    Without this, a rank that raises leaves the others waiting forever in a collective;
    with it, the traceback is printed and ``MPI_Abort`` makes mpiexec (and so the forked
    test) fail at once.
    """
    import functools
    import traceback

    @functools.wraps(test)
    def wrapper(*args: object, **kwargs: object) -> None:
        from mpi4py import MPI

        try:
            test(*args, **kwargs)
        except BaseException:
            if MPI.COMM_WORLD.Get_size() == 1:
                raise
            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)

    return wrapper


def stderr_of(job: "subprocess.Popen[str]", name: str, timeout: float) -> str:
    """Wait for ``job`` and return its stderr; a job still running after ``timeout`` s is
    killed and the test fails naming it (a hang is the failure these tests look for)."""
    try:
        return job.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail(f"{name}: the job hung")


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step, or None; ``.tmp`` leftovers never count (it
    may be damaged: a resume uses ``newest_intact_checkpoint``)."""
    from cosmotrain.train.checkpoints.checkpoint import list_checkpoints

    found = list_checkpoints(directory)
    return found[-1][1] if found else None
