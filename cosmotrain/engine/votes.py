"""The guards' votes: what each rank says about a step, summed over every rank with its loss.

A stop signal or a non-finite gradient is a *local* event (``train/stops.py`` says why a
rank must not act on one alone).  Each rank casts its votes as one :class:`Votes` value;
the step sends them in the loss allreduce it makes anyway (one message of a few doubles,
no extra collective) and hands back the sums, the same on every rank, in its
:class:`~cosmotrain.engine.step.StepOutput`.  A new guard is a new field here, an ``int``
count of the ranks that raised it, set where the event is seen and read where it is acted on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields, replace


@dataclass(frozen=True)
class Votes:
    """This rank's votes before the allreduce (0 or 1 each), every rank's sums after it."""

    stop: int = 0  # ranks that received a stop signal (train.stops.StopSignals)
    bad_gradients: int = 0  # ranks whose previous step's gradients were non-finite

    def values(self) -> tuple[float, ...]:
        """The votes in field order, as the doubles that ride with the loss."""
        return tuple(float(value) for value in astuple(self))

    def summed(self, sums: Sequence[float]) -> Votes:
        """A value of this class holding ``sums`` (field order: :meth:`values`)."""
        names = [f.name for f in fields(self)]
        if len(sums) != len(names):
            raise ValueError(f"{len(sums)} sums for the {len(names)} votes {names}")
        return replace(self, **{name: round(s) for name, s in zip(names, sums)})
