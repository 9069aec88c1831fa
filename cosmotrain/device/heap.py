"""Keep freed host memory in glibc's heap, so that each training step reuses the pages
of the last one (a leaf).

By default glibc serves every block over its mmap threshold (32 MiB at most) with a
fresh ``mmap`` and unmaps it when it is freed.  A training step allocates its large
activations and gradients anew, so every step page-faults all of them in again: on the
2-core reference box (THP on), the first touch of 512 MiB took 76-1320 ms (a compaction
stall now and then) against 40-70 ms to rewrite memory already mapped.  cosmoflow-mlperf
at W=128, batch 2, measured 4.64 s a step with the default and 3.68 s with
:func:`reuse_freed_memory` (PyTorch, in the same process and the same run: 5.63 and 4.34
s; docs/PERFORMANCE.md, "Host memory reuse").  PyTorch users get the same from a
caching allocator (jemalloc or tcmalloc through ``LD_PRELOAD``).

:func:`reuse_freed_memory` sets ``M_MMAP_MAX = 0`` (every block from the heap) and a
high ``M_TRIM_THRESHOLD`` (freed memory is not trimmed).  The peak resident memory is
unchanged, since a step's allocations repeat with the same sizes; what changes is that
the process stays at its peak between steps instead of dropping back.  Memory that must
be handed back between uses lives in its own map (:mod:`.pages`), which this does not
touch.  It is process-wide state of the C library: the job applies it once
(``device.reuse_freed_memory``, :func:`cosmotrain.runtime.job_runtime.build_runtime`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# glibc caps the trim threshold at what fits in an int
NEVER_TRIM = 2**31 - 1


def reuse_freed_memory() -> bool:
    """Keep freed memory for reuse (glibc); False where there is no glibc ``mallopt``."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))


def _mallopt():
    """glibc's ``mallopt``, or None (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
