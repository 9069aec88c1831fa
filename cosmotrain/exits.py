"""How a ``cosmotrain`` command ends: one line and an exit code, on every rank alike.

The CLI maps every failure here.  A :class:`~cosmotrain.errors.UserError` prints its
one-line message once (collective errors on rank 0 only) and exits with its code (2 for
bad input; 3, 4 and 75 for the reliability stops of docs/RELIABILITY.md); a rank-local
error aborts the whole MPI job so that no rank waits forever.  Also the fault hook the
abort tests inject through ``COSMOTRAIN_FAULT`` (read by the CLI, the only reader of the
environment).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from cosmotrain.errors import EXIT_KEYBOARD, EXIT_USER_ERROR, JobStopped, UserError

__all__ = ["EXIT_KEYBOARD", "exit_code", "fault_hook", "report_stop", "report_user_error"]
OTHER_RANKS_WAIT_S = 3.0  # report_stop: how long ranks > 0 leave rank 0 to end the job
FAULT_ENV = "COSMOTRAIN_FAULT"  # "RANK:STEP": raise on that rank before that step (tests)


def fault_hook(fault: str | None) -> Callable[[int, int], None] | None:
    """Fault injection for the abort tests: ``COSMOTRAIN_FAULT=RANK:STEP`` makes that rank
    raise before that step, as a bug would; the whole job must then end, not hang."""
    if not fault:
        return None

    def inject(rank: int, step: int) -> None:
        if fault == f"{rank}:{step}":
            raise RuntimeError(f"fault injected by {FAULT_ENV}={fault}")

    return inject


def report_user_error(err: UserError) -> None:
    """Print the one-line message; a rank-local error then aborts the whole job."""
    from cosmotrain.comm import abort_job, settle_exit

    collective = getattr(err, "collective", True)
    if not collective or _rank_if_initialised() == 0:
        print(f"cosmotrain: error: {err}", file=sys.stderr, flush=True)
    if collective:
        settle_exit()
    else:
        abort_job(exit_code(err))


def report_stop(err: JobStopped) -> None:
    """Print the stop's one line and end every rank of the job with its exit code.

    Further stop signals are ignored from here (a third Ctrl-C must not turn the exit into
    a traceback).  A rank other than 0 waits a few seconds first: when rank 0 stopped too
    (a launcher forwards the signal to every rank), its abort ends this rank before it
    prints, so the line appears once (half a second was not always enough on a loaded
    2-core machine); when only this rank stopped, it still prints and ends the job."""
    import signal
    import time

    from cosmotrain.comm import abort_job

    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)
    if _rank_if_initialised() != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    print(f"cosmotrain: {err}", file=sys.stderr, flush=True)
    abort_job(err.exit_code)


def exit_code(err: UserError) -> int:
    """2 for bad input; a few user-facing failures carry their own (docs/RELIABILITY.md)."""
    return int(getattr(err, "exit_code", EXIT_USER_ERROR))


def _rank_if_initialised() -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        return 0
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
