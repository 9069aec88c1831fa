"""glibc heap reuse for benchmarks: large arrays from the heap, freed memory kept.

By default glibc serves every block over 32 MiB with a fresh ``mmap`` and unmaps it when
freed, so a training step that allocates its large activations and gradients anew
page-faults all of them again each step (with numpy's huge-page advice, sometimes after
a compaction stall: the first touch of 512 MiB measured 76-1320 ms here, against 40-70
ms to rewrite it).  ``mallopt(M_MMAP_MAX, 0)`` and a high ``M_TRIM_THRESHOLD`` make the
heap keep what is freed, so later steps reuse pages that are already mapped.  It is a
process-wide setting: in a benchmark that runs PyTorch in the same process, it applies to
both sides.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def reuse_freed_memory() -> bool:
    """Apply the settings; False where there is no glibc ``mallopt``."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
