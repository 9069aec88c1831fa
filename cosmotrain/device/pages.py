"""Host buffers whose memory can be handed back to the OS between uses (a leaf).

A large numpy array freed back to glibc's malloc either stays resident (served from the
heap, reused only by later allocations that fit) or, when it was memory-mapped, raises
malloc's mmap threshold to its size, after which every freed temporary up to that size
stays resident too.  A buffer needed for part of every step only (a sharded gradient
bucket: from the start of backward until its reduce-scatter completes) is better kept in
its own anonymous memory map: :meth:`PageBuffer.release` tells the kernel its pages are
not needed (``madvise(MADV_DONTNEED)``), the resident memory drops at once, and the next
use faults fresh pages in, without a malloc call on either side.  Where ``madvise`` is
missing, release does nothing and the buffer simply stays resident.
"""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np


class PageBuffer:
    """``size`` elements of ``dtype`` in an anonymous memory map of their own."""

    def __init__(self, size: int, dtype: Any) -> None:
        dtype = np.dtype(dtype)
        # private: a shared anonymous map keeps released pages in its shared-memory
        # object (out of this process's RSS, but not given back)
        self._map = mmap.mmap(-1, max(1, size * dtype.itemsize), flags=mmap.MAP_PRIVATE)
        self.array = np.frombuffer(self._map, dtype=dtype, count=size)
        self._zero = True  # a fresh anonymous map reads as zeros

    def release(self) -> None:
        """Hand the pages back to the OS; the contents are undefined until written."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is not None and hasattr(self._map, "madvise"):
            self._map.madvise(advice)
            # dropped pages of a private anonymous map read as zeros (Linux)
            self._zero = sys.platform.startswith("linux")

    def zeros(self) -> np.ndarray:
        """The array, all zeros, for the caller to write.  Zeros without a write where
        the pages are fresh or were handed back: a page then becomes resident only when
        the caller first writes it (a gradient bucket: when its gradients land)."""
        if not self._zero:
            self.array.fill(0)
        self._zero = False
        return self.array

    def written(self) -> np.ndarray:
        """The array, for the caller to overwrite whole (its contents undefined)."""
        self._zero = False
        return self.array
