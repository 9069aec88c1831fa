"""Stream capture and CUDA graphs for the stand-in cupy (tests/standin.py).

What a real capture does, and how the stand-in does the same on the CPU:

* **Nothing runs while capturing.**  ``stream.begin_capture()`` records work instead of
  running it.  The stand-in computes each operation anyway, because the host code needs
  its results' shapes.  So :meth:`Recorder.begin` copies every live device buffer, and
  :meth:`Recorder.end` writes them back.  Memory that existed before the capture
  therefore holds what it held before, as on a device.
* **A graph replays what was captured, on the same buffers.**  Each launch during
  capture is kept with a closure that recomputes it from its operands' buffers *as they
  are at replay* and writes into the buffers it wrote at capture.  A scalar argument is
  therefore baked in, and a buffer's address is fixed.  ``Graph.launch`` runs the
  closures in order and adds their records to the ledger.  A step that leaves a value
  on the host, or that reads a value the host changed without rewriting device memory,
  replays wrong numbers, and a test sees them.
* **What cupy and CUDA refuse during capture raises** :class:`CaptureError`:
  * any host read or synchronisation;
  * a copy from pageable host memory (``asarray`` of a host array, ``set`` from memory
    that is not pinned);
  * cuBLAS (``matmul``, ``dot``, ``tensordot``, ``einsum``), except at the call sites
    a test names in ``Recorder.blas_sites`` (through its monkeypatch: none by default);
  * capturing without a private memory pool (``cupy.cuda.using_allocator``), whose
    blocks would go back to the shared pool while the graph still uses them.

Why cuBLAS may be allowed at a call site: cuDNN is not importable on the CPU, so the
stand-in's convolutions run the gemm algorithm (numpy ``matmul``).  On a device, capture
needs cuDNN's convolutions, which bind to the capture stream.  A test that says so lets
the gemm module's products stand in for them.  Nothing else gets that allowance.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from standin_ledger import Launch, caller

BLAS = {"matmul", "dot", "tensordot", "einsum", "inner", "vdot"}


class CaptureError(RuntimeError):
    """What the device would refuse during a stream capture."""


@dataclass
class Graph:
    """A captured stream: its launches, replayed in order by :meth:`launch`."""

    recorder: Recorder
    entries: list[tuple[Launch, Callable[[], None]]]

    def launch(self, stream: Any = None) -> None:
        ledger = self.recorder.ledger
        ledger.graphs.append((len(ledger.launches), len(self.entries)))
        for record, replay in self.entries:
            replay()
            ledger.launches.append(record)


@dataclass
class Recorder:
    """The stand-in's live device memory and its capture state."""

    ledger: Any
    pinned: Callable[[np.ndarray], bool]  # whether host memory is pinned
    live: Any = field(default_factory=weakref.WeakValueDictionary)  # device buffers by id
    allocator: Any = None  # the private pool's malloc, inside using_allocator
    blas_sites: set[str] = field(default_factory=set)  # module paths allowed cuBLAS
    entries: list | None = None  # the launches of the capture under way
    saved: list[tuple[Any, np.ndarray]] = field(default_factory=list)
    captures: int = 0

    @property
    def capturing(self) -> bool:
        return self.entries is not None

    def track(self, buffer: np.ndarray) -> None:
        """A new device buffer (a plain ndarray owning its memory)."""
        self.live[id(buffer)] = buffer

    def begin(self) -> None:
        if self.capturing:
            raise CaptureError("begin_capture on a stream that is already capturing")
        if self.allocator is None:
            raise CaptureError("capture without a private memory pool "
                               "(cupy.cuda.using_allocator): its blocks would return to "
                               "the shared pool while the graph still uses them")
        self.saved = [(buffer, buffer.copy()) for buffer in list(self.live.values())]
        self.entries = []

    def end(self) -> Graph:
        if not self.capturing:
            raise CaptureError("end_capture on a stream that is not capturing")
        entries, self.entries = self.entries, None
        for buffer, before in self.saved:
            np.copyto(buffer, before)
        self.saved = []
        self.captures += 1
        return Graph(self, entries)

    def record(self, launch: Launch, replay: Callable[[], None]) -> None:
        if self.capturing:
            self.entries.append((launch, replay))

    def refuse(self, what: str) -> None:
        """Raise when capturing: ``what`` cannot be captured."""
        if self.capturing:
            self.entries = None
            for buffer, before in self.saved:
                np.copyto(buffer, before)
            self.saved = []
            raise CaptureError(f"{what} during a stream capture")

    def check_launch(self, name: str) -> None:
        if self.capturing and name in BLAS:
            site = caller()
            if not any(site.startswith(allowed) for allowed in self.blas_sites):
                self.refuse(f"{name} (cuBLAS) from {site}")

    def check_copy(self, host: Any) -> None:
        if self.capturing and not self.pinned(host):
            self.refuse("a copy from pageable host memory")

    @contextlib.contextmanager
    def using_allocator(self, malloc: Any) -> Iterator[None]:
        before, self.allocator = self.allocator, malloc
        try:
            yield
        finally:
            self.allocator = before


def replay_of(function: Callable, args: tuple, kwargs: dict, outputs: tuple
              ) -> Callable[[], None]:
    """Recompute ``function`` on its operands' buffers as they are then, and write each
    result into the buffer the capture wrote (a view of an operand: itself)."""
    def replay() -> None:
        again = function(*args, **kwargs)
        again = again if isinstance(again, tuple) else (again,)
        for target, value in zip(outputs, again):
            if isinstance(target, np.ndarray) and value is not None \
                    and not (isinstance(value, np.ndarray) and value is target):
                np.copyto(target, value)
    return replay


class MemoryPool:
    """``cupy.cuda.MemoryPool``: the stand-in's arrays come from numpy's heap; the pool
    is what ``using_allocator`` is handed, checked for at capture."""

    def __init__(self) -> None:
        self.requested = 0

    def malloc(self, size: int) -> np.ndarray:
        self.requested += size
        return np.empty(size, dtype=np.uint8)
