"""Collective error helpers: one verdict on every rank, never a hang.

Used by the data layer, the trainer (run directory claim, resume) and the planner.  Work
that one rank does for all (rank 0 reads a manifest, writes a cache) is run through
:func:`on_root`: the result, or the user error it raised, is broadcast, and every rank
returns the same value or raises the same error (marked collective, so the CLI prints it
once and exits 2 without aborting).  Work split over the ranks (one file each) can fail on
one rank only; that rank raises its :class:`DataError`, which the CLI turns into an abort
of the whole job, so the others never wait in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from cosmotrain.errors import ConfigError, DataError, UserError

T = TypeVar("T")
_KINDS: dict[str, type[UserError]] = {"DataError": DataError, "ConfigError": ConfigError,
                                      "UserError": UserError}


def self_comm(comm: Any) -> Any:
    """``comm``, or ``MPI.COMM_SELF`` for a serial caller that passed None."""
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_SELF


def on_root(comm: Any, work: Callable[[], T]) -> T:
    """Run ``work`` on rank 0 of ``comm``; every rank gets its result or its user error."""
    outcome: tuple[str, Any] | None = None
    if comm.Get_rank() == 0:
        try:
            outcome = ("ok", work())
        except UserError as err:
            outcome = (type(err).__name__, str(err))
    outcome = comm.bcast(outcome, root=0)
    if outcome[0] != "ok":
        raise collective_error(outcome[0], outcome[1])
    return outcome[1]


def agree(comm: Any, message: str | None, kind: str = "UserError") -> None:
    """Raise the lowest failing rank's ``message`` on every rank (a collective verdict)."""
    first = next((m for m in comm.allgather(message) if m), None)
    if first is not None:
        raise collective_error(kind, first)


def together(comm: Any, work: Callable[[], T]) -> T:
    """Run ``work`` on every rank of ``comm``; if it raised a user error on any rank, every
    rank raises the lowest failing rank's error (collective: printed once, exit 2).

    For work split over the ranks that can fail on several of them at once (the same bad
    file read by every rank holding one of its blocks): one verdict instead of one message
    per rank and an abort.  Costs one small allreduce when nothing failed.
    """
    try:
        result, failure = work(), None
    except UserError as err:
        result, failure = None, (type(err).__name__, str(err))
    if comm.allreduce(int(failure is not None)):
        kind, message = next(f for f in comm.allgather(failure) if f is not None)
        raise collective_error(kind, message)
    return result  # type: ignore[return-value]


def everyone(err: UserError) -> UserError:
    """``err``, marked as raised by every rank alike (a check of data all ranks hold)."""
    err.collective = True
    return err


def collective_error(kind: str, message: str) -> UserError:
    """A user error of class ``kind`` with exactly ``message``, raised by every rank alike.

    The classes' constructors compose messages from parts; a broadcast carries the finished
    message, so the instance is built without re-composing it.
    """
    cls = _KINDS.get(kind, UserError)
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.collective = True
    return err
