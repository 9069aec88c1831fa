"""The compiled part of the CPU kernels: one shared library, loaded with ctypes.

``cosmotrain.kernels.compiled._directconv`` is built by ``pip install`` (setup.py) from
``native/*.c`` with the system's C compiler and is optional: without it the numpy
kernels run everything.  ctypes releases the GIL for the duration of each call, so the
kernel workers of :mod:`cosmotrain.kernels.cpu.workers` run compiled chunks on all cores.  Users:
:mod:`.direct` and :mod:`.winograd` (convolutions), :mod:`.maxpool_tiled` and
:mod:`.avgpool` (pooling).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from typing import Optional

import numpy as np

LONG, INT, FLOAT, POINTER = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The compiled library, loaded once; None when the install did not build it."""
    spec = importlib.util.find_spec("cosmotrain.kernels.compiled._directconv")
    if spec is None or not spec.origin:
        return None
    try:
        return ctypes.CDLL(spec.origin)
    except OSError:
        return None


def function(name: str, argtypes: list, restype=None
             ) -> Optional[ctypes._CFuncPtr]:  # type: ignore[name-defined]
    """The library's function ``name`` with its argument and result types, or None
    without the library."""
    lib = library()
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def functions(*specs: tuple) -> Optional[tuple]:
    """The functions of ``(name, argtypes[, restype])`` specs, all of them or None (the
    library missing): a kernel takes its compiled path whole or not at all."""
    found = tuple(function(*spec) for spec in specs)
    return None if None in found else found


def check(status: int, what: str) -> None:
    """A compiled function's status: 0, or -1 when it could not allocate its buffers
    (it then wrote nothing usable)."""
    if status != 0:
        raise MemoryError(f"{what}: out of memory for the compiled loops' buffers")


def address(a: np.ndarray) -> int:
    """The data pointer of ``a`` handed to a compiled function."""
    return a.ctypes.data


def element_strides(a: np.ndarray) -> tuple:
    """``a``'s strides in elements (the compiled functions index in elements)."""
    return tuple(s // a.itemsize for s in a.strides)
