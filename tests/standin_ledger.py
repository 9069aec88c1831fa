"""The records of the stand-in cupy (tests/standin.py): what a step asked of the device,
in order, and how an array operation is described (shapes, dtypes, scalars, addresses,
the bytes it reads and writes)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Ledger:
    """What the device was asked to do, in order."""

    syncs: list[str] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    allocations: list[tuple] = field(default_factory=list)
    uploads: list[tuple] = field(default_factory=list)
    downloads: list[tuple] = field(default_factory=list)
    sync_sites: list[str] = field(default_factory=list)  # module:function of each sync
    graphs: list[tuple] = field(default_factory=list)  # graph launches: (first, count)
    counting: bool = True
    on_sync: Any = None  # called with each sync's reason (a capture refuses it)

    def clear(self) -> None:
        for entries in (self.syncs, self.launches, self.allocations, self.uploads,
                        self.downloads, self.sync_sites, self.graphs):
            entries.clear()

    def take(self) -> Ledger:
        """What was recorded since the last take (a copy), and start afresh."""
        taken = Ledger(list(self.syncs), list(self.launches), list(self.allocations),
                       list(self.uploads), list(self.downloads), list(self.sync_sites),
                       list(self.graphs))
        self.clear()
        return taken

    def bytes_moved(self) -> int:
        """Bytes the recorded launches read and wrote (the byte budget, docs/PERFORMANCE.md
        "GPU: compulsory traffic")."""
        return sum(launch.read + launch.written for launch in self.launches)

    def sync(self, why: str) -> None:
        if self.on_sync is not None:
            self.on_sync(why)
        if self.counting:
            self.syncs.append(why)
            self.sync_sites.append(caller())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is recorded inside (the test's own reads of results)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before


def caller() -> str:
    """``module:function`` of the innermost cosmotrain frame on the stack."""
    for frame in reversed(traceback.extract_stack()):
        if "/cosmotrain/" in frame.filename.replace("\\", "/"):
            return f"{frame.filename.rsplit('/cosmotrain/', 1)[1]}:{frame.name}"
    return "?"


def plain_arrays(value: Any) -> Any:
    """``value`` with every stand-in array (nested in lists/tuples) as a plain ndarray."""
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        return value.view(np.ndarray)
    if isinstance(value, (list, tuple)):
        return type(value)(plain_arrays(v) for v in value)
    return value


def describe(values: Any) -> tuple:
    """Shapes and dtypes of the arrays, values of the scalars, in order (no addresses)."""
    out = []
    for value in values:
        if isinstance(value, np.ndarray):
            out.append((value.shape, value.dtype.str))
        elif isinstance(value, (list, tuple)):
            out.append(describe(value))
        elif isinstance(value, (int, float, str, bool, np.generic, type(None))):
            out.append(value)
        else:
            out.append(type(value).__name__)
    return tuple(out)


def addresses_of(values: Any) -> tuple:
    """The buffer address of each array among ``values`` (nested), in order."""
    return tuple(v.__array_interface__["data"][0] for v in flat(values)
                 if isinstance(v, np.ndarray))


@dataclass(frozen=True)
class Launch:
    """One kernel launch: what a CUDA graph would record of it."""

    kernel: str
    signature: tuple  # operand shapes and dtypes, scalar arguments, result shapes
    addresses: tuple  # buffer addresses of operands and results
    read: int = 0  # bytes of the arrays it reads (its operands)
    written: int = 0  # bytes of the arrays it writes (its results)


def array_bytes(values: Any) -> int:
    """Bytes of every array among ``values`` (nested), each as often as it appears."""
    return sum(v.nbytes for v in flat(values) if isinstance(v, np.ndarray))


def flat(values: Any) -> Iterator[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from flat(value)
        else:
            yield value
