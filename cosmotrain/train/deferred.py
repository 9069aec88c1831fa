"""Reading a device step's loss and votes one step late, so the host never waits on it.

A device step leaves its loss and its guards' votes on the device
(``engine/device_verdict.py``: :class:`~cosmotrain.engine.device_verdict.DeferredSums`).
Reading them right after the step makes the host wait for the whole step before it may
queue the next one: the device then idles while the host reads the next batch and
launches the next step's kernels.  So the trainer reads step k's values at step k + 1,
after step k + 1 is queued (:class:`OneBehind`): that read waits only for step k, while
step k + 1 is already on the device behind it.

The guarantees of docs/RELIABILITY.md hold with the read one step late:

* a non-finite step is never applied: the device flag skips it, and skips the step after
  it too (its vote carries the bad gradients), so a step launched before the host saw
  the verdict changes nothing;
* a non-finite step is never checkpointed: before every boundary where the trainer may
  write a checkpoint or validate (the last step, an epoch's end, a checkpoint due by
  steps, a stop) the step just launched is read at once (``settle``), so every step a
  checkpoint contains has had its verdict read, and a bad one raised
  :class:`~cosmotrain.train.stops.NonFiniteError` first;
* a stop signal stops at a checkpoint: the step that carries the stop vote is read at
  the next step, which is then read at once and is the step the checkpoint holds (one
  step later than an eagerly read step would stop);
* the records are those of the eager read, one per step and in order: each keeps the
  figures taken when it was launched (its step, samples, rate, the reader's figures),
  and only its wall time is measured from its launch to the next step's.

A step whose values are already on the host (the CPU path) is accounted as soon as it
is handed over, exactly as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cosmotrain.engine.step import StepOutput


@dataclass
class Launched:
    """A launched step and what its metrics record needs, taken when it was launched
    (by the time it is read the reader and the timers have moved on to the next)."""

    out: StepOutput
    step: int  # optimizer steps taken once it is applied: its record's ``step``
    samples: int  # samples seen once it is applied
    batch: int  # its batch's samples on this rank
    lr: float
    started: float  # ``time.perf_counter()`` when it began
    timers: dict[str, float]  # the runtime's timers over the step
    wait_s: float  # the reader's wait for its batch
    io: dict[str, float]  # the reader's figures for its batch


# Checks and records a step whose values were read; True when it voted to stop.
Account = Callable[[Launched, float], bool]


class OneBehind:
    """Holds at most one launched step whose loss and votes the host has not read.

    ``account(step, wall_s)`` reads a step's values (the one host wait), raises when it
    went non-finite and records it; it returns whether the step voted to stop."""

    def __init__(self, account: Account) -> None:
        self._account = account
        self._pending: Launched | None = None

    @property
    def pending(self) -> Launched | None:
        """The launched step not yet read, if any."""
        return self._pending

    def push(self, launched: Launched, settle: bool = False) -> bool:
        """Take the step just launched: read the one before it, then this one too when
        its values are on the host already, when ``settle`` (a boundary follows: a
        checkpoint, a validation, the end) or when the one before voted to stop.

        Returns whether a step read here voted to stop; when it does, nothing is left
        pending."""
        stop = False
        before, self._pending = self._pending, None
        if before is not None:
            stop = self._account(before, launched.started - before.started)
        if launched.out.deferred and not (settle or stop):
            self._pending = launched
            return stop
        return self._account(launched, time.perf_counter() - launched.started) or stop
