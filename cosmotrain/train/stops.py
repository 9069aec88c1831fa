"""What may end a run between two steps: a stop signal, or a value gone non-finite.

Both are *local* events: a signal reaches each rank at its own moment (srun and mpiexec
forward it to every task, but not at the same instant), and a NaN may appear in one
rank's block only.  Acting on a local event alone would hang the job (one rank leaves the
loop while the others wait in the next collective) or let a bad value reach a checkpoint.
So each rank only *records* the event, as a vote in one small typed value
(:class:`cosmotrain.engine.votes.Votes`, a field per guard) that travels in the one
collective every step already makes, the allreduce of the loss: every rank then sees the
same sums (``StepOutput.votes``) and takes the same decision at the same step.

- :class:`StopSignals` turns SIGTERM (Slurm's time limit and preemption), SIGINT (Ctrl-C,
  forwarded by mpiexec) and SIGUSR1 (``sbatch --signal=USR1@T``, ahead of the limit) into a
  request: the step in flight finishes, every rank agrees, a checkpoint is written at that
  step boundary and the run ends with ``stop_reason: interrupted``.  Installed before the
  job is built (``at_once``), a signal met during start-up or the preload pass ends the
  command at once instead, with exit 75 (:class:`~cosmotrain.errors.JobStopped`), until
  :meth:`StopSignals.defer` hands the signals to the loop.  A second SIGINT is the
  impatient user's: it ends every rank at once with exit 130, whatever is in flight (a
  checkpoint write is left as before: atomic writes remove their temporary file).
- ``device.xp.all_finite`` is the per-step check of this rank's gradients; the step
  carries its verdict to the next loss allreduce, and :class:`NonFiniteError` ends the run
  before a non-finite value can be stored.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any

from cosmotrain.errors import EXIT_KEYBOARD, JobStopped, UserError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped cleanly at a checkpoint; resume to continue
EXIT_NON_FINITE = 3  # the run diverged (or read non-finite values); nothing bad was saved


class NonFiniteError(UserError):
    """The loss or a gradient went non-finite; every rank raises it at the same step.

    Collective (every rank holds the same verdict), so the CLI prints it once.  It is not
    bad *input* in the usual sense, so it carries its own exit code.
    """

    exit_code = EXIT_NON_FINITE


START_UP = "start-up, before the first step; nothing was saved or half-written"
STAGING = ("staging; the copies made so far stay, and the stage directory is refused as "
           "unfinished until the same preload completes it")


class StopSignals:
    """Records the first stop signal; use as a context manager around the training loop.

    With ``at_once`` (start-up: nothing is there for a step boundary to save yet) a stop
    signal raises :class:`JobStopped` (exit 75) where the main thread is, until
    :meth:`defer`.  Installing the handlers also replaces MPICH's own SIGUSR1 handler,
    which MPI_Init sets in every rank and which drops the signal (the ``--signal=USR1@T``
    of a batch script) without a word.  Only the main thread may install signal
    handlers; the previous handlers come back on exit, so library callers (tests,
    benchmarks) are left as they were.
    """

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS, *, at_once: bool = False,
                 during: str = START_UP) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None
        self.at_once = at_once
        self.during = during  # what the line says was under way, and what is left
        self._previous: dict[int, Any] = {}

    def defer(self) -> None:
        """From now on only record a signal: the training loop takes it at a step boundary."""
        self.at_once = False

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def __enter__(self) -> StopSignals:
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and number == signal.SIGINT:
            raise JobStopped("interrupted again (a second SIGINT): every rank stops now, "
                             "without a checkpoint; a checkpoint being written is left as "
                             "before; continue from the last one with --resume",
                             EXIT_KEYBOARD)
        if self.received is None:
            self.received = number
        if self.at_once:
            raise JobStopped(f"stopped: {signal.Signals(number).name} received during "
                             f"{self.during}: run the same command again (exit "
                             f"{EXIT_INTERRUPTED}: train.sbatch requeues it)",
                             EXIT_INTERRUPTED)


def non_finite_message(step: int, loss: float, bad_gradients: int) -> str:
    """The one line that ends a diverged run; ``step`` is 1-based (steps completed)."""
    what = []
    if bad_gradients:
        what.append(f"the gradients of step {step - 1} on {bad_gradients} rank(s)")
    if not math.isfinite(loss):
        what.append(f"the loss of step {step} ({loss})")
    return (f"training stopped: {' and '.join(what) or 'a value'} went non-finite; no "
            f"checkpoint holds it. Lower optimizer.lr (or add warm-up), check the input "
            f"data, then resume from the last checkpoint with --resume")
