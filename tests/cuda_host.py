"""Run our CUDA kernels' own sources on the CPU: each ``.cu`` file built by the host C++
compiler behind ``src/host_shim.h`` into a shared library, loaded with ctypes.

``HostLauncher`` has :func:`cosmotrain.kernels.cuda.raw.cupy_launch`'s signature, so the
Python faces (:mod:`cosmotrain.kernels.cuda.raw_ops`) run on numpy arrays through it:
same grids' arithmetic, same argument packing.  The grid is shrunk to a few blocks of a
few threads (every kernel is a grid-stride loop, so any grid gives the same results;
several threads still exercise the stride), each thread one ctypes call; a kernel with
a barrier (``raw.PHASES``) runs phase by phase over each block's threads, and one with
real barriers (``__syncthreads`` in its source: batchnorm.cu's reductions, a barrier
at each level of a tree) runs the threads of each block concurrently, one OS thread
each (ctypes releases the GIL), so that the shim's barrier holds them together.

Builds are cached under the temp folder, keyed by the hash of the source, the headers
and the compiler command, so the suite compiles each source once per change.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pytest

from cosmotrain.kernels.cuda import raw

COMPILER = shutil.which("g++") or shutil.which("c++")
FLAGS = ("-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
         "-x", "c++")
CACHE = Path(tempfile.gettempdir()) / "cosmotrain-cuda-host"
# The shrunken grid: blocks x threads, each thread one ctypes call.
GRID, BLOCK = 3, 4


def need_compiler() -> None:
    if COMPILER is None:
        pytest.skip("no host C++ compiler (g++ / c++) to run the CUDA sources on the CPU")


@functools.cache
def library(source: str) -> ctypes.CDLL:
    """The host build of ``src/<source>`` (cached on disk by content)."""
    need_compiler()
    path = raw.SOURCE_DIR / source
    command = [COMPILER, *FLAGS, "-include", str(raw.SOURCE_DIR / "host_shim.h"),
               f"-I{raw.SOURCE_DIR}"]
    digest = hashlib.sha256(" ".join(command).encode())
    for part in (path, *(raw.SOURCE_DIR / h for h in raw.HEADERS)):
        digest.update(part.read_bytes())
    target = CACHE / f"{path.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{id(target)}.tmp")
        subprocess.run([*command, str(path), "-o", str(partial)], check=True,
                       capture_output=True, text=True)
        partial.replace(target)  # atomic: a concurrent run sees a whole library or none
    return ctypes.CDLL(str(target))


_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "l": ctypes.c_int64,
           "f": ctypes.c_float, "d": ctypes.c_double, "u": ctypes.c_uint64}


def _address(array: np.ndarray) -> int:
    if not array.flags.c_contiguous:
        raise ValueError("the kernels take C-contiguous arrays")
    return array.ctypes.data


class HostLauncher:
    """Runs a kernel over a small grid on the CPU; counts the launches it was asked for."""

    def __init__(self, grid: int = GRID, block: int = BLOCK) -> None:
        self.grid, self.block, self.launches = grid, block, []

    def __call__(self, kernel: str, size: int, args: Sequence[Any]) -> None:
        source, codes = raw.KERNELS[kernel]
        lib = library(source)
        function = getattr(lib, kernel)
        function.argtypes = [_CTYPES[c] for c in codes]
        function.restype = None
        values = [int(v) if c in "pilu" else float(v)
                  for c, v in zip(codes, raw.pack(kernel, args, _address))]
        (ctypes.c_uint * 3).in_dll(lib, "gridDim")[:] = [self.grid, 1, 1]
        (ctypes.c_uint * 3).in_dll(lib, "blockDim")[:] = [self.block, 1, 1]
        phases = raw.PHASES.get(kernel, 1)

        def thread(b: int, t: int) -> None:
            lib.cosmo_thread(b, t)  # thread-local: set on the thread that runs the kernel
            function(*values)
        for b in range(self.grid):
            if phases == 1 and synchronising(source):
                threads = [threading.Thread(target=thread, args=(b, t))
                           for t in range(self.block)]
                for running in threads:
                    running.start()
                for running in threads:
                    running.join()
                continue
            for phase in range(phases):  # a barrier: every thread of the block, in turn
                if phases > 1:
                    ctypes.c_int.in_dll(lib, "cosmo_phase").value = phase
                for t in range(self.block):
                    thread(b, t)
        self.launches.append((kernel, size))


@functools.cache
def synchronising(source: str) -> bool:
    """Whether ``src/<source>`` synchronises the threads of a block."""
    return "__syncthreads" in (raw.SOURCE_DIR / source).read_text()


def run(kernel: str, *args: Any, launcher: Optional[HostLauncher] = None) -> None:
    """One launch of ``kernel`` on the CPU (``size`` is only recorded)."""
    (launcher or HostLauncher())(kernel, 0, args)
