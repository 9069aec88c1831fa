"""BLAS threads per rank from the ranks sharing a node."""

from __future__ import annotations

import pytest

from cosmotrain.runtime.threads import job_threads, threads_per_rank
from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels.cpu.workers import KernelThreads


def configure_threads(comm) -> int:
    """Decide this rank's threads (collective) and apply them now, as a job's runtime
    does; returns the BLAS thread count."""
    threads = job_threads(comm)
    _parallel.configure_threads(threads)
    return threads.blas


@pytest.mark.parametrize("local, usable, node, expected", [
    (1, 16, 16, 16),  # alone on the node: every core
    (4, 16, 16, 4),  # unbound ranks share the node equally
    (8, 2, 2, 1),  # more ranks than cores: one thread each
    (4, 3, 16, 3),  # bound by the launcher to 3 cores: its own budget
])
def test_threads_per_rank(local: int, usable: int, node: int, expected: int) -> None:
    assert threads_per_rank(local, usable, node) == expected


def test_threads_per_rank_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="positive counts"):
        threads_per_rank(0, 4, 4)


def test_configure_threads_sets_the_kernel_workers() -> None:
    from mpi4py import MPI

    if _parallel._blas() is None:  # noqa: SLF001
        pytest.skip("no controllable OpenBLAS in this process")
    before = _parallel.num_workers()
    try:
        threads = configure_threads(MPI.COMM_SELF)
        assert threads >= 1
        assert _parallel.num_workers() == threads
    finally:
        _parallel.set_blas_threads(before)


@pytest.mark.parametrize("env,expected", [
    ({}, None), ({"OPENBLAS_NUM_THREADS": "3"}, 3), ({"OMP_NUM_THREADS": "2"}, 2),
    ({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "8"}, 1),
    ({"OPENBLAS_NUM_THREADS": "lots"}, None), ({"OMP_NUM_THREADS": "0"}, None)])
def test_an_explicit_thread_count_caps_the_share(env: dict, expected: int | None) -> None:
    from cosmotrain.runtime.threads import env_thread_limit

    assert env_thread_limit(env) == expected


def test_configure_threads_respects_openblas_num_threads(monkeypatch) -> None:
    from mpi4py import MPI

    if _parallel._blas() is None:  # noqa: SLF001
        pytest.skip("no controllable OpenBLAS in this process")
    before = _parallel.num_workers()
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    try:
        assert configure_threads(MPI.COMM_SELF) == 1
    finally:
        _parallel.set_blas_threads(before)


def test_job_threads_decide_without_setting_anything(monkeypatch) -> None:
    from mpi4py import MPI

    monkeypatch.setattr(_parallel, "set_blas_threads", lambda count: pytest.fail("applied"))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    assert job_threads(MPI.COMM_SELF) == KernelThreads(1)


def test_kernel_threads_are_applied_through_one_entry_point(monkeypatch) -> None:
    applied = []
    monkeypatch.setattr(_parallel, "set_blas_threads", lambda count: applied.append(count) or True)
    assert _parallel.configure_threads(KernelThreads(2)) and applied == [2]
    with pytest.raises(TypeError, match="KernelThreads"):
        _parallel.configure_threads(2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            KernelThreads(bad)


def _spin_seen_by_a_fresh_process(env_value: str | None, numpy_first: bool) -> str:
    """``blas_thread_timeout()`` in a new interpreter importing numpy and cosmotrain."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if env_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = env_value
    imports = "import numpy, cosmotrain" if numpy_first else "import cosmotrain, numpy"
    code = (f"{imports}\nfrom cosmotrain.kernels.cpu.workers import blas_thread_timeout\n"
            "print(blas_thread_timeout())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_importing_cosmotrain_first_shortens_the_idle_blas_spin() -> None:
    """OpenBLAS's idle threads spin 2**28 cycles by default, on the cores the kernel
    workers need; cosmotrain sets 2**4 before numpy loads OpenBLAS, keeps a user's value,
    and cannot change it once numpy has loaded it (0: OpenBLAS's default)."""
    import cosmotrain

    if _parallel.blas_thread_timeout() is None:
        pytest.skip("no controllable OpenBLAS in this process")
    assert _spin_seen_by_a_fresh_process(None, numpy_first=False) == \
        cosmotrain.BLAS_THREAD_TIMEOUT
    assert _spin_seen_by_a_fresh_process("20", numpy_first=False) == "20"
    assert _spin_seen_by_a_fresh_process(None, numpy_first=True) == "0"
