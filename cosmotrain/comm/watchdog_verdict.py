"""The watchdog's pure rules: deadlines, a round's verdict and its one-line message.

No MPI and no threads: :mod:`cosmotrain.comm.watchdog` runs the rounds and calls these,
and the tests check every rule and message without starting a job.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_TIMEOUT_S = 300.0
#: The deadline is never shorter than this many times the slowest interval between beats.
INTERVAL_FACTOR = 10.0
#: Ranks named in full in a message; the rest are counted.
MAX_NAMED = 8


def deadline_s(timeout_s: float, slowest_interval_s: float, allowance_s: float = 0.0,
               factor: float = INTERVAL_FACTOR) -> float:
    """Seconds without a beat after which a rank counts as stalled.

    ``max(timeout_s, factor * slowest_interval_s) + allowance_s``: the configured timeout,
    stretched so that it is never shorter than ``factor`` times the slowest interval between
    two beats seen so far (a slow machine's long steps never trigger it), plus the extra
    time of the :meth:`Watchdog.allow` phases in progress.  Intervals that overlap an
    allowed phase do not count as step intervals.
    """
    return max(timeout_s, factor * slowest_interval_s) + allowance_s


def default_grace_s(timeout_s: float) -> float:
    """How long a round waits for answers: a tenth of the timeout, within [2, 15] s."""
    return min(max(0.1 * timeout_s, 2.0), 15.0)


def default_poll_s(timeout_s: float) -> float:
    """How often the thread wakes: a twentieth of the timeout, within [0.05, 1] s."""
    return min(max(timeout_s / 20.0, 0.05), 1.0)


class Report(NamedTuple):
    """One rank's status, as its watchdog thread sees it (and sends it)."""

    step: int  # the last step passed to beat(); -1 before the first
    stalled: bool  # past its deadline
    idle_s: float  # since the last beat
    remaining_s: float  # until the deadline; negative once stalled


@dataclass(frozen=True)
class Verdict:
    """The outcome of a round: ``wait`` (ask again in ``rearm_s``) or ``abort``."""

    action: str
    suspects: tuple[int, ...] = ()
    printer: int = -1  # the rank that prints the line and aborts at once
    rearm_s: float = 0.0


def judge(rank: int, others: Iterable[int], fresh: Mapping[int, Report],
          departed: Iterable[int], grace_s: float) -> Verdict:
    """Judge a round of stalled ``rank``: ``fresh`` holds what each rank sent since it began.

    Ranks that sent nothing and did not stop their watchdog are suspects: abort.  Otherwise,
    wait while some rank is within its deadline (ask again when the nearest such deadline
    passes, at least ``grace_s`` later); abort when all are stalled.  The printer is the
    lowest stalled rank this rank knows of (itself included).
    """
    gone = set(departed)
    suspects = tuple(sorted(r for r in others if r not in fresh and r not in gone))
    if not suspects:
        left = [report.remaining_s for report in fresh.values() if not report.stalled]
        if left:
            return Verdict("wait", rearm_s=max(grace_s, min(left)))
    stalled = [rank] + [r for r, report in fresh.items() if report.stalled]
    return Verdict("abort", suspects, printer=min(stalled))


def name_ranks(ranks: Sequence[int], hosts: Sequence[str]) -> str:
    """``rank 2 (host a)`` or ``ranks 1 (host a), 3 (host b)``, at most MAX_NAMED in full."""
    ranks = sorted(ranks)
    named = ", ".join(f"{r} (host {hosts[r]})" for r in ranks[:MAX_NAMED])
    if len(ranks) > MAX_NAMED:
        named += f" and {len(ranks) - MAX_NAMED} more"
    return ("rank " if len(ranks) == 1 else "ranks ") + named


def step_text(step: int) -> str:
    return f"last step {step}" if step >= 0 else "before the first step"


def describe(verdict: Verdict, rank: int, me: Report, fresh: Mapping[int, Report],
             departed: Iterable[int], hosts: Sequence[str]) -> str:
    """The one-line message for an ``abort`` verdict reached by ``rank``."""
    waited = f"{me.idle_s:.0f} s"
    if verdict.suspects:
        count = len(verdict.suspects)
        who = name_ranks(verdict.suspects, hosts)
        verb = "does" if count == 1 else "do"
        return (f"watchdog: {who} made no progress and {verb} not respond; the other ranks "
                f"waited {waited} for {'it' if count == 1 else 'them'} "
                f"({step_text(me.step)}); ending the job")
    by_step: dict[int, list[int]] = {}
    for r, report in {**fresh, rank: me}.items():
        by_step.setdefault(report.step, []).append(r)
    steps = "; ".join(f"{step_text(step)} on {name_ranks(ranks, hosts)}"
                      for step, ranks in sorted(by_step.items()))
    gone = sorted(departed)
    left = f"; {name_ranks(gone, hosts)} already stopped" if gone else ""
    return (f"watchdog: no rank made progress for {waited}, yet every running rank responds: "
            f"a deadlock or a hung collective ({steps}{left}); ending the job")
