"""Run independent chunks of a kernel on several cores, one single-threaded BLAS each.

Why: the convolution kernels alternate memory-bound copies (padding, im2col, shifted
adds: numpy, which releases the GIL but uses one core) with small GEMMs.  Letting BLAS
thread each small GEMM leaves the copies serial and makes the BLAS threads spin while we
copy.  Measured on the 2-core reference box (conv 4->16 on 128^3, forward): 79 ms with
serial copies + 2-thread BLAS, 64 ms with 2 Python workers each running copies +
1-thread BLAS on their own chunks.  So while a kernel runs, OpenBLAS is switched to one
thread and a pool of as many workers as BLAS had threads processes the chunks; the BLAS
thread count is restored afterwards.

The BLAS thread count is changed through the OpenBLAS C API found in the process
(``*openblas_set_num_threads*``, as threadpoolctl does).  Without OpenBLAS (MKL,
Accelerate, non-Linux) chunks run in the calling thread and BLAS threads itself: correct,
just without parallel copies.  With one BLAS thread (``OPENBLAS_NUM_THREADS=1``, several
MPI ranks per node) there is one worker.  :func:`set_num_workers` overrides the count.
The pool is rebuilt after ``fork`` (mpi-pytest's forking mode), whose child has no threads.

Why the pool and the thread count stay per process rather than flowing down as a value
(as the GPU convolution settings do): OpenBLAS's thread count is process-global state of
the C library, shared by every numpy call in the process whoever makes it, and the
workers follow it (a pool larger than BLAS's thread budget oversubscribes the cores the
launcher gave the rank).  Handing a count to every kernel call could not give two jobs
in one process different BLAS thread counts; it would only hide the one global behind
an argument.  So a job decides its threads once (a :class:`KernelThreads`, from
:func:`cosmotrain.runtime.threads.job_threads`), its :class:`~cosmotrain.runtime.job_runtime.Runtime`
records them, and they are applied once, through :func:`configure_threads`: the one entry
point that sets a job's kernel threads (tools that time kernels, ``study/``, may still
call :func:`set_blas_threads` / :func:`set_num_workers` directly).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, TypeVar

import numpy as np

from cosmotrain.device import step_memory

T = TypeVar("T")
R = TypeVar("R")


class _OpenBLAS:
    """get/set of the OpenBLAS thread count of one loaded library."""

    def __init__(self, get: Callable[[], int], set_: Callable[[int], None],
                 thread_timeout: Optional[Callable[[], int]] = None) -> None:
        self.get = get
        self.set = set_
        self.thread_timeout = thread_timeout


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
        for prefix, suffix in itertools.product(("scipy_openblas_", "openblas_"), ("64_", "")):
            get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            set_ = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype = ctypes.c_int
                set_.argtypes = [ctypes.c_int]
                set_.restype = None
                timeout = getattr(lib, "openblas_thread_timeout", None)
                if timeout is not None:
                    timeout.restype = ctypes.c_int
                return _OpenBLAS(get, set_, timeout)
    return None


class _State:
    """Process-wide pool and BLAS bookkeeping (reset in a forked child)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.probed = False
        self.blas: Optional[_OpenBLAS] = None
        self.workers: Optional[int] = None  # set_num_workers override
        self.active = 0                     # kernels running with BLAS at one thread
        self.saved = 1                      # BLAS thread count to restore
        self.executor: Optional[ThreadPoolExecutor] = None


_state = _State()


def _after_fork_in_child() -> None:
    global _state
    old, _state = _state, _State()
    _state.probed, _state.blas, _state.workers = old.probed, old.blas, old.workers
    if old.active and old.blas is not None:  # forked in the middle of a kernel
        old.blas.set(old.saved)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _blas() -> Optional[_OpenBLAS]:
    with _state.lock:
        if not _state.probed:
            _state.probed = True
            _state.blas = _find_openblas()
        return _state.blas


def blas_thread_timeout() -> Optional[int]:
    """How long OpenBLAS's idle threads spin: ``n`` for 2**n cycles, 0 for OpenBLAS's
    default (2**28), None without a controllable OpenBLAS.  ``cosmotrain/__init__.py``
    sets it low before numpy loads OpenBLAS: long spins steal this module's workers'
    cores."""
    blas = _blas()
    if blas is None or blas.thread_timeout is None:
        return None
    return int(blas.thread_timeout())


def num_workers() -> int:
    """Workers used for chunked kernels: set explicitly, else OpenBLAS's thread count."""
    if _state.workers is not None:
        return _state.workers
    blas = _blas()
    if blas is None:
        return 1
    with _state.lock:
        count = blas.get() if _state.active == 0 else _state.saved
    return max(1, int(count))


def set_num_workers(count: Optional[int]) -> None:
    """Fix the worker count (``None``: follow OpenBLAS's thread count again)."""
    if count is not None and count < 1:
        raise ValueError(f"worker count must be >= 1, got {count}")
    _state.workers = count


def set_blas_threads(count: int) -> bool:
    """Set OpenBLAS's thread count (the workers follow it); False without OpenBLAS."""
    if count < 1:
        raise ValueError(f"BLAS thread count must be >= 1, got {count}")
    blas = _blas()
    if blas is None:
        return False
    with _state.lock:
        if _state.active:
            _state.saved = count  # restored to this when the running kernel ends
        else:
            blas.set(count)
    return True


@dataclass(frozen=True)
class KernelThreads:
    """A job's kernel threads: OpenBLAS's thread count, which is also the number of
    workers the chunked kernels use (:func:`num_workers`)."""

    blas: int

    def __post_init__(self) -> None:
        if isinstance(self.blas, bool) or not isinstance(self.blas, int) or self.blas < 1:
            raise ValueError(f"KernelThreads.blas must be a positive int, got {self.blas!r}")


def configure_threads(threads: KernelThreads) -> bool:
    """Apply a job's ``threads`` to this process (once, when the job's runtime is built);
    False when no controllable OpenBLAS is loaded (BLAS then threads itself)."""
    if not isinstance(threads, KernelThreads):
        raise TypeError(f"configure_threads() takes a KernelThreads, got "
                        f"{type(threads).__name__}")
    return set_blas_threads(threads.blas)


def _enter_single_blas(blas: _OpenBLAS) -> None:
    with _state.lock:
        if _state.active == 0:
            _state.saved = blas.get()
            blas.set(1)
        _state.active += 1


def _leave_single_blas(blas: _OpenBLAS) -> None:
    with _state.lock:
        _state.active -= 1
        if _state.active == 0:
            blas.set(_state.saved)


def _pool(count: int) -> ThreadPoolExecutor:
    with _state.lock:
        old = _state.executor
        if old is None or old._max_workers < count:  # noqa: SLF001
            _state.executor = ThreadPoolExecutor(count, thread_name_prefix="cosmotrain-kernel")
            if old is not None:
                old.shutdown(wait=False)
        return _state.executor


def map_chunks(work: Callable[[T], R], chunks: Sequence[T]) -> List[R]:
    """Apply ``work(chunk)`` to every chunk; results in chunk order.

    Workers take chunks dynamically; use :func:`scratch` for per-thread buffers.  Chunks
    must be independent (disjoint outputs).  With one worker (or no controllable BLAS)
    this is a plain loop in the calling thread and BLAS keeps its own threads.
    """
    count = min(num_workers(), len(chunks))
    blas = _blas()
    if count <= 1 or blas is None:
        results = [work(chunk) for chunk in chunks]
        if step_memory.planning():
            # the calling thread's scratch goes back to the step's plan, which shares its
            # pages with the step's other arrays (kept, it is memory beside every peak)
            _local.buffers = {}
        return results
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


def sum_in_order(partials: Sequence[np.ndarray]) -> np.ndarray:
    """The chunk partials of a reduction (a filter gradient) added in chunk order, into
    the first: the same bits whatever the workers' schedule."""
    total = partials[0]
    for part in partials[1:]:
        total += part
    return total


_local = threading.local()


def scratch(name: str, shape: Sequence[int], dtype) -> np.ndarray:
    """A reusable uninitialised buffer private to the calling thread.

    Kernels call this once per chunk; the memory is kept between calls (per thread and
    name, grown when a larger one is asked for) so that no chunk pays page faults.  In a
    step under planned memory (:mod:`cosmotrain.device.step_memory`) the calling
    thread's buffers are kept only until its :func:`map_chunks` returns: the plan then
    places them among the step's arrays, whose pages it reuses anyway.
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
