"""Streams and events of the stand-in cupy (tests/standin.py), with copies that can lag.

Why: a copy queued on a side stream from pinned memory reads its source when the device
runs it, not when the host queues it.  The stand-in computes everything else eagerly, so
by default a queued copy runs at once; in **lagging** mode (``Streams.lagging = True``)
a copy queued on a stream other than the current (compute) one waits in that stream's
queue until something orders it: an event recorded after it is waited on by another
stream (``wait_event``) or by the host (``synchronize``), or the stream itself is
synchronised.  So a stage that forgets the compute stream's ``wait_event`` reads stale
device memory, and one that rewrites a pinned buffer before its copy ran copies the new
bytes into the old batch's slot: both show up as wrong values in a test.

``Streams.slow_events``: events say they are not done (``.done`` False) until the host
synchronises them, as on a device that is still busy, so a test sees whether a host
check waits where it must.  Each host wait is a sync in the ledger, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class Streams:
    """The ``Stream`` and ``Event`` classes of one stand-in, sharing its ledger."""

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.lagging = False
        self.slow_events = False
        self.current: Any = None
        self.recorder: Any = None  # the stand-in's capture state (tests/standin_graph.py)
        self.pinned: list[np.ndarray] = []
        # in order: ("copy", stream, target address) and ("wait", waiting stream, the
        # event's stream): what a test checks the device-side order of a stage against
        self.log: list[tuple[str, Any, Any]] = []
        self.Event = self._event_class()
        self.Stream = self._stream_class()
        self.current = self.Stream()

    def _event_class(self) -> type:
        streams = self

        class Event:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.stream: Any = None
                self.position = 0
                self.synchronised = False

            def record(self, stream: Any = None) -> None:
                self.stream = stream if stream is not None else streams.current
                self.position = self.stream.queued

            def settle(self) -> None:
                """Run what its stream queued before it (device-side ordering)."""
                if self.stream is not None:
                    self.stream.run_until(self.position)

            @property
            def done(self) -> bool:
                if streams.slow_events and not self.synchronised:
                    return False
                return self.stream is None or self.stream.ran >= self.position

            def synchronize(self) -> None:
                streams.ledger.sync("event.synchronize")
                self.synchronised = True
                self.settle()

        return Event

    def _stream_class(self) -> type:
        streams = self

        class Stream:
            ptr = 0

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.pending: list[Callable[[], None]] = []
                self.queued = 0  # copies queued on this stream so far
                self.ran = 0  # of which run

            def enqueue(self, copy: Callable[[], None], target: int = 0) -> None:
                """A copy on this stream: at once, or later when lagging off the current one."""
                streams.log.append(("copy", self, target))
                self.pending.append(copy)
                self.queued += 1
                if not streams.lagging or self is streams.current:
                    self.run_until(self.queued)

            def run_until(self, position: int) -> None:
                while self.ran < position:
                    self.pending.pop(0)()
                    self.ran += 1

            def record(self, event: Any = None) -> Any:
                event = event if event is not None else streams.Event()
                event.record(self)
                return event

            def wait_event(self, event: Any) -> None:
                streams.log.append(("wait", self, event.stream))
                event.settle()

            def synchronize(self) -> None:
                streams.ledger.sync("stream.synchronize")
                self.run_until(self.queued)

            def __enter__(self) -> Any:
                """``with stream:``: the current stream inside."""
                self.before = streams.current
                streams.current = self
                return self

            def __exit__(self, *exc: Any) -> None:
                streams.current = self.before

            def begin_capture(self, mode: Any = None) -> None:
                streams.recorder.begin()

            def end_capture(self) -> Any:
                return streams.recorder.end()

            def is_capturing(self) -> bool:
                return streams.recorder.capturing

        return Stream

    def get_current_stream(self) -> Any:
        return self.current

    def reset(self) -> None:
        """Eager copies and honest events again (each installation starts so)."""
        self.lagging = self.slow_events = False
        self.pinned.clear()
        self.log.clear()

    def empty_pinned(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        """``cupyx.empty_pinned``: host memory, remembered as pinned."""
        array = np.empty(shape, dtype)
        self.pinned.append(array)
        return array

    def is_pinned(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies in a buffer of :meth:`empty_pinned`."""
        return any(np.shares_memory(array, p) for p in self.pinned)
