"""MPI communication: the world communicator and (later) the Cartesian process grid.

mpi4py is imported lazily so that importing cosmotrain never initialises MPI; commands
ask for the communicator when they need it.
"""

from __future__ import annotations

from typing import Any


def world() -> Any:
    """``MPI.COMM_WORLD`` (initialises MPI on first use)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def abort_job(code: int) -> None:
    """End every rank of the job when MPI is running with more than one rank."""
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        MPI.COMM_WORLD.Abort(code)
