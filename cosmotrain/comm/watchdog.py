"""A watchdog that ends a job whose rank stopped making progress, naming the rank and host.

A frozen rank (``SIGSTOP``, a hung node) would otherwise leave every other rank waiting in
a collective until the scheduler kills the job.  Each rank runs a :class:`Watchdog`: the
main thread calls :meth:`Watchdog.beat` after each unit of progress (a step, a validation
batch, a checkpoint) and a daemon thread compares the time since the last beat with the
rank's deadline (:func:`deadline_s`).

When the deadline passes, the thread finds out *which* ranks are not responding.  mpi4py
initialises MPI with ``MPI_THREAD_MULTIPLE`` and releases the GIL in blocking calls, so the
thread runs, and communicates, while the main thread waits in a collective.  A stalled rank
starts a *round*: it sends a small ``QUERY`` (its status: last step, stalled or not, time
left to its deadline) to every other rank on a private duplicate of the communicator; every
watchdog thread that runs answers each ``QUERY`` with a ``REPLY`` carrying its own status,
whether or not it is stalled itself.  After at most ``grace_s`` the round is judged
(:func:`judge`):

- ranks that sent nothing since the round began are *suspects* (a stopped process's threads
  do not run): the job is ended, naming them and their hosts;
- if every rank answered and one of them is still within its deadline (a long checkpoint in
  :meth:`Watchdog.allow`), the rank waits and asks again when that deadline would pass;
- if every rank answered and all are stalled, the job is deadlocked (or a collective hangs):
  it is ended, naming the last step of each rank.

One line is printed, by the lowest stalled rank of the verdict (``announce``, by default
stderr), for example::

    cosmotrain: error: watchdog: rank 1 (host nid0012) made no progress and does not
    respond; the other ranks waited 300 s for it (last step 5); ending the job

(one line in reality), then ``MPI.COMM_WORLD.Abort(EXIT_WATCHDOG)`` (exit code 4:
``mpiexec`` of MPICH's Hydra then exits 4 too and kills every rank, a stopped one included).
The other stalled ranks keep answering and act only as a backstop: if the job is still
alive ``3 * grace_s + 2`` s after their own verdict, they print the line and abort.

A rank calling :meth:`Watchdog.stop` sends ``BYE`` to the others, so a rank that finished
is reported as such and never as frozen.

Fallbacks: with a single rank, or when MPI provides less than ``MPI_THREAD_MULTIPLE``, the
thread makes no MPI calls: on its deadline it prints this rank's own view and ends the job
(``MPI_Abort`` when the world has several ranks, ``os._exit(EXIT_WATCHDOG)`` for a single
process).  Without ``THREAD_MULTIPLE`` every healthy rank prints its own line, since they
cannot agree on a printer.

A frozen rank is therefore detected ``deadline + grace_s + poll_s`` (plus the 0.5 s the
printer waits before aborting, so that the launcher forwards its line) after its peers' last
beat.  The trainer builds one watchdog per job (no process-wide state).

Limitations: a healthy rank whose main thread holds the GIL inside one C call for longer
than the others' deadline plus ``grace_s`` (h5py holds it during I/O) cannot answer and is
named as not responding.  A round costs one small message from each stalled rank to every
other rank and one answer back: O(ranks^2) messages when all ranks stall together.  Call
:meth:`Watchdog.stop` at the same point on every rank: a rank that stopped early is
reported as "already stopped" if the others then wait on it past their deadline.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cosmotrain.comm import ABORT_GRACE_S
from cosmotrain.comm.watchdog_verdict import (DEFAULT_TIMEOUT_S, INTERVAL_FACTOR, Report,
                                              deadline_s, default_grace_s, default_poll_s,
                                              describe, judge, name_ranks, step_text)
from cosmotrain.errors import EXIT_WATCHDOG

QUERY, REPLY, BYE = 1, 2, 3
_TAG = 7036
_FIELDS = 5  # kind, step, stalled, idle (ms), time left to the deadline (ms)


def _say_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Watchdog:
    """Ends the job when this rank's main thread makes no progress for its deadline.

    ``Watchdog(comm, timeout_s, announce)`` is collective over ``comm`` (it gathers the
    hostnames and the MPI thread levels and duplicates ``comm``).  ``announce(line)`` prints
    the final line, ``"cosmotrain: error: watchdog: ..."`` (default: stderr).  The deadline
    is :func:`deadline_s`: ``timeout_s`` (default 300 s), never less than ``interval_factor``
    times the slowest interval between beats, plus the allowances of :meth:`allow` phases in
    progress.  ``grace_s`` and ``poll_s`` default to :func:`default_grace_s` and
    :func:`default_poll_s`.

    :meth:`beat` and :meth:`allow` belong to the main thread and are lock-free and MPI-free;
    :meth:`start` starts the daemon thread; :meth:`stop` (collective-free, idempotent, also
    registered with ``atexit`` so the thread is gone before mpi4py finalizes MPI) ends it,
    and a stopped watchdog never fires.  A single-rank job is watched too: a hung process is
    ended with ``os._exit(EXIT_WATCHDOG)``.
    """

    def __init__(self, comm: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
                 announce: Callable[[str], None] | None = None, *,
                 interval_factor: float = INTERVAL_FACTOR, grace_s: float | None = None,
                 poll_s: float | None = None, exit_code: int = EXIT_WATCHDOG) -> None:
        from mpi4py import MPI

        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.interval_factor = float(interval_factor)
        self.grace_s = default_grace_s(timeout_s) if grace_s is None else float(grace_s)
        self.poll_s = default_poll_s(timeout_s) if poll_s is None else float(poll_s)
        self.exit_code = exit_code
        self.announce = announce or _say_stderr
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        gathered = comm.allgather((MPI.Get_processor_name(), MPI.Query_thread()))
        self.hosts = tuple(host for host, _ in gathered)
        #: Whether the ranks' threads talk to each other to name the frozen rank.
        self.threaded = self.size > 1 and min(lv for _, lv in gathered) >= MPI.THREAD_MULTIPLE
        self._comm = comm.Dup() if self.threaded else None
        self._last = time.monotonic()
        self._slowest = 0.0
        self._allow_s = 0.0
        self._allow_depth = 0
        self._step = -1
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._pending: list[tuple[Any, Any]] = []  # sends in flight and their buffers

    # -- main thread -----------------------------------------------------------------------

    def beat(self, step: int | None = None) -> None:
        """Progress: a step, a validation batch, a checkpoint is done (no locks, no MPI)."""
        now = time.monotonic()
        if not self._allow_depth:
            gap = now - self._last
            if gap > self._slowest:
                self._slowest = gap
        self._last = now
        if step is not None:
            self._step = step

    @contextmanager
    def allow(self, extra_s: float) -> Iterator[Watchdog]:
        """A known long phase: the deadline is ``extra_s`` longer while it lasts.

        Entering and leaving count as progress; the phase's duration is not a step
        interval.  Phases may nest (their allowances add up)."""
        if extra_s < 0:
            raise ValueError(f"watchdog allowance must be >= 0, got {extra_s}")
        self._allow_depth += 1
        self._allow_s += extra_s  # lengthen first: the thread only ever sees a laxer view
        self._last = time.monotonic()
        try:
            yield self
        finally:
            self._last = time.monotonic()
            self._allow_depth -= 1
            self._allow_s = self._allow_s - extra_s if self._allow_depth else 0.0

    def start(self) -> Watchdog:
        """Start the daemon thread (once); the deadline counts from now."""
        if self._thread is None and not self._stopped:
            self._last = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="cosmotrain-watchdog",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """End the thread; it never fires afterwards.  No collective; safe to call twice."""
        acquired = self._lock.acquire(timeout=ABORT_GRACE_S + 2.0)
        self._stopped = True
        if acquired:
            self._lock.release()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 4 * self.poll_s))
        atexit.unregister(self.stop)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- watchdog thread -------------------------------------------------------------------

    def report(self, now: float | None = None) -> Report:
        """This rank's status now."""
        now = time.monotonic() if now is None else now
        last, slowest, allowance, step = self._last, self._slowest, self._allow_s, self._step
        limit = deadline_s(self.timeout_s, slowest, allowance, self.interval_factor)
        idle = now - last
        return Report(step, idle > limit, idle, limit - idle)

    def _run(self) -> None:
        try:
            if self._comm is None:
                self._watch_alone()
            else:
                self._watch_ranks()
        except Exception as exc:  # noqa: BLE001 - the watchdog must never break a job
            if not self._stopped:
                self.announce(f"cosmotrain: warning: watchdog on rank {self.rank} stopped "
                              f"after an internal error: {exc!r}")

    def _watch_alone(self) -> None:
        """Single rank, or no THREAD_MULTIPLE: this rank's own view, no MPI calls."""
        while not self._wake.wait(self.poll_s):
            me = self.report()
            if not me.stalled:
                continue
            who = name_ranks([self.rank], self.hosts)
            line = (f"watchdog: {who} made no progress for {me.idle_s:.0f} s "
                    f"({step_text(me.step)})")
            if self.size > 1:
                line += ("; another rank may be frozen, but MPI provides no "
                         "THREAD_MULTIPLE, so the watchdog cannot tell which")
            self._end(line + "; ending the job")

    def _watch_ranks(self) -> None:
        """The protocol of the module docstring, on the private communicator."""
        import numpy as np
        from mpi4py import MPI

        comm = self._comm
        others = [r for r in range(self.size) if r != self.rank]
        buffer = np.zeros(_FIELDS, dtype=np.int64)
        status = MPI.Status()
        receive = comm.Irecv(buffer, MPI.ANY_SOURCE, _TAG)
        heard: dict[int, tuple[float, Report]] = {}
        departed: set[int] = set()
        round_start: float | None = None
        next_round = 0.0
        backstop: tuple[float, str] | None = None
        try:
            while not self._wake.wait(self.poll_s):
                now = time.monotonic()
                me = self.report(now)
                while receive.Test(status):
                    source, kind, report = status.Get_source(), int(buffer[0]), _decode(buffer)
                    receive = comm.Irecv(buffer, MPI.ANY_SOURCE, _TAG)
                    if kind == BYE:
                        departed.add(source)
                        heard.pop(source, None)
                        continue
                    heard[source] = (now, report)
                    if kind == QUERY:
                        self._send(REPLY, me, [source])
                self._pending = [(req, buf) for req, buf in self._pending if not req.Test()]
                if backstop is not None:
                    if not me.stalled:
                        backstop = None  # this rank moves again: it was a false alarm
                    elif now >= backstop[0]:
                        self._end(backstop[1])
                    continue
                if round_start is None:
                    if me.stalled and now >= next_round:
                        round_start = now
                        self._send(QUERY, me, [r for r in others if r not in departed])
                    continue
                if not me.stalled:
                    round_start = None
                    continue
                fresh = {r: report for r, (t, report) in heard.items() if t >= round_start}
                silent = any(r not in fresh and r not in departed for r in others)
                if silent and now < round_start + self.grace_s:
                    continue
                round_start = None
                verdict = judge(self.rank, others, fresh, departed, self.grace_s)
                if verdict.action == "wait":
                    next_round = now + verdict.rearm_s
                    continue
                line = describe(verdict, self.rank, me, fresh, departed, self.hosts)
                if verdict.printer == self.rank:
                    self._end(line)
                backstop = (now + 3 * self.grace_s + 2.0, line)
        finally:
            self._leave(receive, others, departed)

    def _send(self, kind: int, me: Report, ranks: Iterable[int]) -> None:
        import numpy as np

        message = np.array([kind, me.step, int(me.stalled), _ms(me.idle_s),
                            _ms(me.remaining_s)], dtype=np.int64)
        for r in ranks:
            self._pending.append((self._comm.Isend(message, r, _TAG), message))

    def _leave(self, receive: Any, others: Sequence[int], departed: set[int]) -> None:
        """Cancel the receive, tell the others this rank no longer answers, free the comm.

        Local operations only: the ``BYE`` sends are not waited for (their buffers stay
        referenced by ``self``)."""
        from mpi4py import MPI

        if MPI.Is_finalized():
            return
        receive.Cancel()
        receive.Wait()
        self._send(BYE, self.report(), [r for r in others if r not in departed])
        self._comm.Free()

    def _end(self, line: str) -> None:
        """Print ``line`` and end the job, unless stop() came first; never returns then."""
        from cosmotrain.comm import abort_job

        if not self._lock.acquire(timeout=1.0) or self._stopped:
            return  # stop() holds the lock or has run: a stopped watchdog never fires
        try:
            self.announce(f"cosmotrain: error: {line}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            abort_job(self.exit_code)  # waits ABORT_GRACE_S, then MPI_Abort when ranks > 1
            os._exit(self.exit_code)


def _ms(seconds: float) -> int:
    """Milliseconds for the int64 message, an infinite allowance included."""
    return round(min(max(seconds, -1e12), 1e12) * 1000)


def _decode(buffer: Any) -> Report:
    step, stalled, idle_ms, remaining_ms = (int(v) for v in buffer[1:_FIELDS])
    return Report(step, bool(stalled), idle_ms / 1000.0, remaining_ms / 1000.0)
