"""One background thread that fetches the next item while the caller computes.

The file reads of the direct reader are mostly in HDF5 and numpy, and the training step
is mostly in BLAS and numpy kernels that release the GIL, so a reader thread overlaps the
step.  The thread never touches MPI.  A failure in it (a corrupt file) is re-raised in the
caller's thread when the caller asks for that item, so it ends the job like any other
error; a fetch the caller never asks for (it stopped, or jumped elsewhere) is discarded
with its error.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """``get(key, work)`` returns ``work()``, run ahead by ``schedule(key, work)`` if it was."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cosmotrain-prefetch")
        self._pending: tuple[Hashable, Future[T]] | None = None

    def get(self, key: Hashable, work: Callable[[], T]) -> T:
        """The item for ``key``: the prefetched one (waiting for it), else ``work()`` now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == key:
            return pending[1].result()  # re-raises the thread's exception here
        _discard(pending)
        return work()

    def schedule(self, key: Hashable, work: Callable[[], T]) -> None:
        """Start ``work`` for ``key`` in the background (replacing any unclaimed fetch)."""
        _discard(self._pending)
        self._pending = (key, self._pool.submit(work))

    def close(self) -> None:
        """Wait for the thread to finish its fetch and stop it (idempotent)."""
        _discard(self._pending)
        self._pending = None
        self._pool.shutdown(wait=True)


def _discard(pending: tuple[Hashable, Future] | None) -> None:
    """Drop an unclaimed fetch: cancel it, or let it finish and forget its outcome."""
    if pending is not None and not pending[1].cancel():
        pending[1].exception()  # waits; the error belongs to a batch nobody asked for
