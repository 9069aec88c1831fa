"""MPI communication: the world communicator, node placement and job-wide exits (here).

The package also owns the process grid (``grid``: sub-communicators per axis and group),
the collective error helpers that give every rank one verdict (``collective``), the
communication timers of a step's time breakdown (``timers``), the BLAS threads per rank
(``threads``) and the watchdog that ends a job whose rank stopped (``watchdog``).

mpi4py is imported lazily so that importing cosmotrain never initialises MPI; commands
ask for the communicator when they need it.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.device.probe import node_position


def world() -> Any:
    """``MPI.COMM_WORLD`` (initialises MPI on first use)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def node_ranks(comm: Any) -> int:
    """How many ranks of ``comm`` share this rank's node (collective)."""
    return node_position(comm)[1]


ABORT_GRACE_S = 0.5


def abort_job(code: int) -> None:
    """End every rank of the job when MPI is running with more than one rank.

    The launcher forwards each rank's stderr asynchronously: aborting at once after the
    message could let it tear the job down before the message is out (Hydra lost a rank's
    traceback in 2 of 11 runs on the 2-core development machine), so the rank first
    waits ``ABORT_GRACE_S``."""
    import time

    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(code)


def settle_exit(timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` s) until every rank reaches its exit after a collective error.

    Every rank raises a collective error alike and rank 0 prints it; a rank that exited at
    once could make the launcher kill rank 0 before its message is out.  A non-blocking
    barrier with a deadline keeps the message without risking a hang when an error was
    marked collective but raised on some ranks only.
    """
    import time

    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    request = MPI.COMM_WORLD.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)
