"""Wall-clock seconds per communication phase: the step's time breakdown.

Distributed layers charge the time they spend packing, posting and *waiting* for
messages to a phase (``halo``, ``allreduce``, ``redistribution``, ``channel``: the
channel/filter all-gathers and reduce-scatters) of the job's runtime's
:class:`PhaseTimers`; everything else in a step is compute.  Time hidden behind compute
by non-blocking messages is, correctly, not charged: only what the rank waited for is.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("halo", "allreduce", "redistribution", "channel")


class PhaseTimers:
    """Accumulates seconds per phase until :meth:`take` hands them over and resets."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The accumulated seconds per phase; the counters restart from zero."""
        taken, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return taken
