"""Run independent chunks of a kernel on several cores, one single-threaded BLAS each.

Why: the convolution kernels alternate a memory-bound copy (im2col / col2im, numpy,
releases the GIL but uses one core) with a small GEMM (BLAS).  Letting BLAS thread each
small GEMM leaves the copies serial and makes the BLAS threads spin while we copy.
Measured on the 2-core reference box (conv 4->16 on 128^3, forward): 79 ms with a serial
copy + 2-thread BLAS, 64 ms with 2 Python workers each running copy + 1-thread BLAS on
its own chunks.  So while a kernel runs, OpenBLAS is switched to one thread and a thread
pool of as many workers as BLAS had threads processes the chunks; afterwards the BLAS
thread count is restored.

The BLAS thread count is changed through the OpenBLAS C API found in the process
(``*openblas_set_num_threads*``), as threadpoolctl does.  When no OpenBLAS is found (MKL,
Accelerate, non-Linux), everything runs in the calling thread and BLAS threads itself:
correct, just without the parallel copies.  :func:`set_num_workers` overrides the count
(e.g. the backend sets 1 when several MPI ranks share a node).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, List, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
R = TypeVar("R")

_PREFIXES = ("scipy_openblas_", "openblas_")
_SUFFIXES = ("64_", "")


class _OpenBLAS:
    """get/set of the OpenBLAS thread count of one loaded library."""

    def __init__(self, get: Callable[[], int], set_: Callable[[int], None]) -> None:
        self.get = get
        self.set = set_


def _find_openblas() -> Optional[_OpenBLAS]:
    """Locate the OpenBLAS that numpy loaded (Linux: via /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.isfile(p)):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in itertools.product(_PREFIXES, _SUFFIXES):
            get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype = ctypes.c_int
                set_.argtypes = [ctypes.c_int]
                set_.restype = None
                return _OpenBLAS(get, set_)
    return None


_lock = threading.Lock()
_state = {"probed": False, "blas": None, "workers": None, "active": 0, "saved": 1}
_executor: Optional[ThreadPoolExecutor] = None


def _blas() -> Optional[_OpenBLAS]:
    with _lock:
        if not _state["probed"]:
            _state["probed"] = True
            _state["blas"] = _find_openblas()
        return _state["blas"]


def num_workers() -> int:
    """Workers used for chunked kernels: set explicitly, else OpenBLAS's thread count."""
    if _state["workers"] is not None:
        return _state["workers"]
    blas = _blas()
    if blas is None:
        return 1
    with _lock:
        count = blas.get() if _state["active"] == 0 else _state["saved"]
    return max(1, int(count))


def set_num_workers(count: Optional[int]) -> None:
    """Fix the worker count (``None``: follow OpenBLAS's thread count again)."""
    if count is not None and count < 1:
        raise ValueError(f"worker count must be >= 1, got {count}")
    _state["workers"] = count


def _enter_single_blas(blas: _OpenBLAS) -> None:
    with _lock:
        if _state["active"] == 0:
            _state["saved"] = blas.get()
            blas.set(1)
        _state["active"] += 1


def _leave_single_blas(blas: _OpenBLAS) -> None:
    with _lock:
        _state["active"] -= 1
        if _state["active"] == 0:
            blas.set(_state["saved"])


def _pool(count: int) -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None or _executor._max_workers < count:  # noqa: SLF001
            _executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="cosmotrain-kernel")
        return _executor


def map_chunks(work: Callable[[T], R], chunks: Sequence[T]) -> List[R]:
    """Apply ``work(chunk)`` to every chunk; results in chunk order.

    Workers take chunks dynamically; use :func:`scratch` for per-thread buffers.  Chunks must be
    independent (disjoint outputs).  With one worker (or no controllable BLAS) this is a
    plain loop in the calling thread, BLAS keeps its own threads.
    """
    count = min(num_workers(), len(chunks))
    blas = _blas()
    if count <= 1 or blas is None:
        return [work(chunk) for chunk in chunks]
    results: List[Optional[R]] = [None] * len(chunks)
    counter = itertools.count()  # next() is atomic under the GIL: dynamic scheduling

    def worker() -> None:
        while (i := next(counter)) < len(chunks):
            results[i] = work(chunks[i])

    _enter_single_blas(blas)
    try:
        futures = [_pool(count).submit(worker) for _ in range(count)]
        wait(futures)  # all workers finish before BLAS threads are restored
    finally:
        _leave_single_blas(blas)
    for future in futures:
        future.result()  # re-raise the first worker error, if any
    return results  # type: ignore[return-value]


_local = threading.local()


def scratch(name: str, shape: Sequence[int], dtype) -> "np.ndarray":
    """A reusable uninitialised buffer private to the calling thread.

    Kernels call this once per chunk; the memory is kept between calls (per thread and
    name, grown when a larger one is asked for) so that no chunk pays page faults.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = buffers[name] = np.empty(max(nbytes, 64), dtype=np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)
