"""BLAS threads per rank from the ranks sharing a node."""

from __future__ import annotations

import pytest

from cosmotrain.comm.threads import configure_threads, threads_per_rank
from cosmotrain.kernels import _parallel


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
