"""Array-module selection: numpy on the CPU, cupy on GPUs.

Kernels pick ``xp`` from their inputs (Chainer's convention), so the same code serves both
devices; cupy is imported only when it is installed, and only on first use.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np


@functools.cache
def _cupy() -> ModuleType | None:
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        return None
    return cupy


def array_module(*arrays: Any) -> ModuleType:
    """``cupy`` if any argument is a cupy array, else ``numpy``."""
    cupy = _cupy()
    if cupy is not None:
        for array in arrays:
            if isinstance(array, cupy.ndarray):
                return cupy
    return np
