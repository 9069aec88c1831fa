"""Planned host memory for the large arrays of repeated steps (a leaf).

With freed memory kept in glibc's heap (:mod:`.heap`) a step reuses the pages of the last,
which saves re-faulting every large array in (22-26% of a CPU step at W = 256), but the
heap places each block where the first fitting hole was.  At the peak of a W = 256 step
on a D2H2 rank a quarter of the heap was holes: 1205 MiB a rank against 910 with glibc's
defaults (docs/PERFORMANCE.md).

A training step allocates the same large arrays in the same order every time, which
turns placement into an offline problem.  :func:`install` makes a compiled allocator
(``cosmotrain.device._step_arena``) numpy's: inside :func:`phase` it numbers every array
of at least ``threshold`` bytes the phase's thread allocates and logs its lifetime; at
the end of the phase :func:`place` packs those lifetimes into one address range (largest
first, each at the lowest offset free for its whole lifetime: the span is the bytes live
at once, or within a few percent of it), and the next phase of the same kind hands array
k its planned offset in an arena reserved once, whose pages stay resident between steps.
No page is faulted twice and no hole outlives a step.

An array the plan does not fit (a different size at index k, a range still in use) is a
miss: the phase abandons its plan, hands the arena's unused pages back, gives every
later array a memory map of its own (unmapped when freed, so the step peaks at what it
holds) and is planned again from its new log.  So a phase that changes (the first
steps, which allocate the optimizer state; a smaller last batch) costs one unplanned
step, never a wrong result.  Arrays outside a phase, those of other threads and those
that outlived their phase when it was planned come from malloc.  The first phase of
each kind also hands the heap's free pages back (``malloc_trim``): what the job freed
before it would otherwise stay resident beside the arena.

Like numpy's own allocator, this one asks the kernel for transparent huge pages for large
arrays (the arena, the misses' maps, malloc's blocks of 4 MiB and up) when numpy does:
without them a W = 128 step ran 4% slower.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import numpy as np

#: Arrays below this size are left to malloc (its small-block bins serve them well).
THRESHOLD_BYTES = 1 << 20
#: The most numbered arrays a phase is planned for (placement is quadratic in them: 0.08 s
#: at this many on the dev box, a cost paid again by a phase that keeps changing); a phase
#: of more is left to malloc from then on.
MAX_PLANNED = 1024
#: Address space reserved for the arena: never more than the host's memory.
DEFAULT_ARENA_BYTES = 1 << 40
#: Where a plan puts an array it leaves to malloc (alive when its phase ended).
UNPLANNED = np.iinfo(np.uint64).max


@dataclass
class Plan:
    """Array k of a phase: its size (bytes, page-rounded) and offset in the arena."""

    sizes: np.ndarray
    offsets: np.ndarray

    @classmethod
    def empty(cls) -> "Plan":
        return cls(np.zeros(0, np.uint64), np.zeros(0, np.uint64))

    @property
    def span(self) -> int:
        """The arena bytes the plan uses."""
        used = self.offsets != UNPLANNED
        return int((self.offsets[used] + self.sizes[used]).max()) if used.any() else 0


def place(sizes: Sequence[int], born: Sequence[int], died: Sequence[int]) -> Plan:
    """Offsets for arrays of ``sizes`` alive from tick ``born`` until ``died`` (-1: still
    alive at the end of the phase, left to malloc) such that no two arrays alive at the
    same time overlap.  Largest first, each at the lowest offset clear of the arrays
    already placed whose lifetimes meet its own."""
    sizes = np.asarray(sizes, np.uint64)
    offsets = np.full(len(sizes), UNPLANNED, np.uint64)
    placed: list[int] = []
    order = sorted((k for k in range(len(sizes)) if died[k] >= 0),
                   key=lambda k: (-int(sizes[k]), born[k]))
    for k in order:
        busy = sorted((int(offsets[j]), int(offsets[j] + sizes[j])) for j in placed
                      if born[j] < died[k] and born[k] < died[j])
        offset = 0
        for start, stop in busy:
            if offset + int(sizes[k]) <= start:
                break
            offset = max(offset, stop)
        offsets[k] = offset
        placed.append(k)
    return Plan(sizes, offsets)


class StepMemory:
    """The process's planned allocator: one plan per kind of phase ("train", "eval")."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self._plans: dict[str, Plan] = {}
        self._unplannable: set[str] = set()  # kinds of phase with too many arrays
        self.active: Optional[str] = None  # the kind of the phase under way
        self.replans = 0

    @contextlib.contextmanager
    def phase(self, kind: str) -> Iterator[None]:
        """Number and plan the large arrays allocated in the block (one thread's)."""
        if self.active is not None or kind in self._unplannable:
            yield  # nested (the outer phase numbers everything), or left to malloc
            return
        plan = self._plans.get(kind)
        if plan is None:
            # what the job freed before its first step of this kind stays in the heap
            # (kept, device/heap.py) and would add to every step's peak: hand it back
            self._native.trim()
            plan = Plan.empty()
        self.active = kind
        self._native.begin(plan.sizes.tobytes(), plan.offsets.tobytes())
        try:
            yield
        finally:
            self.active = None
            sizes, born, died, misses = self._native.end()
            if misses or (sizes and not len(plan.sizes)):
                self._replan(kind, sizes, born, died)

    def _replan(self, kind: str, sizes: bytes, born: bytes, died: bytes) -> None:
        sizes_, born_, died_ = (np.frombuffer(b, np.int64) for b in (sizes, born, died))
        if len(sizes_) > MAX_PLANNED:
            self._unplannable.add(kind)
            return
        self._plans[kind] = place(sizes_, born_.tolist(), died_.tolist())
        self.replans += 1

    def statistics(self) -> dict:
        """The arena's counters: bytes reserved, touched (resident) and in use, arrays
        placed by plan and left to malloc by a miss, and the phases planned."""
        return dict(self._native.statistics(), replans=self.replans,
                    plans={kind: plan.span for kind, plan in self._plans.items()})


_memory: Optional[StepMemory] = None


def install(threshold: int = THRESHOLD_BYTES, arena_bytes: Optional[int] = None
            ) -> bool:
    """Make the planned allocator numpy's for this thread's context (the main thread: the
    job's); False where the compiled part is missing or the arena cannot be reserved (the
    heap alone then serves, as before).  Idempotent."""
    global _memory
    native = _native_module()
    if native is None or _strict_overcommit():
        return False
    try:
        native.install(threshold, arena_bytes or _arena_bytes(), _numpy_hugepages())
    except OSError:
        return False
    if _memory is None:
        _memory = StepMemory(native)
    return True


def phase(kind: str) -> contextlib.AbstractContextManager:
    """The block of one repeated step of ``kind``, planned once installed; nothing
    otherwise."""
    return _memory.phase(kind) if _memory is not None else contextlib.nullcontext()


def describe() -> str:
    """What a job's host allocator will be (``cosmotrain info``)."""
    if _native_module() is None:
        return "glibc heap (device._step_arena not built: planned step memory unavailable)"
    if _strict_overcommit():
        return "glibc heap (vm.overcommit_memory = 2: no arena reserved)"
    return "planned step memory over glibc's heap (device.plan_step_memory)"


def planning() -> bool:
    """Whether large arrays allocated now are placed by a plan (inside a phase of the
    installed allocator): a buffer needed for part of a step is then best an ordinary
    array, whose pages the plan shares with the step's other arrays."""
    return _memory is not None and _memory.active is not None


def current() -> Optional[StepMemory]:
    """The installed planned allocator, or None."""
    return _memory


def _native_module() -> Any:
    try:
        return importlib.import_module("cosmotrain.device._step_arena")
    except ImportError:
        return None


def _numpy_hugepages() -> bool:
    """Whether numpy's own allocator asks the kernel for transparent huge pages for its
    large arrays (its default on Linux): the arena then does the same."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return bool(importlib.import_module(name)._get_madvise_hugepage())
        except (ImportError, AttributeError):
            continue
    return False


def _strict_overcommit() -> bool:
    """Whether the kernel charges every mapping in full (``vm.overcommit_memory = 2``),
    where reserving the arena would take commit space from every later allocation."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as mode:
            return mode.read().strip() == "2"
    except OSError:
        return False


def _arena_bytes() -> int:
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_ARENA_BYTES
    return min(DEFAULT_ARENA_BYTES, int(host))
