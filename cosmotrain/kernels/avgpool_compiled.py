"""Average pooling (zero padding counted) through the compiled loops of
``native/avgpool.c``, for float32 numpy arrays.

Why: :mod:`.pool3d`'s numpy kernel sums windows separably with strided slice operations;
the paper network's first pooling (16 x 128^3 floats a sample) took 30 ms forward and
66 ms backward of its 0.5 s step on the AVX-512 box of 2026-11-27.  The loops sum each
output row's input rows into a row buffer and then its taps along W in one pass, and
run the transposed gather backward.  Every output (and input-gradient) element sums its
terms in one fixed order whatever part of the volume a call covers, so slabs of planes
(``by_planes``) give one call's results bit for bit, as the numpy kernel's plane-by-plane
mode does.  Results differ from the numpy kernel's at float32 rounding (another order).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import numpy as np

from . import _parallel, compiled

# False: the numpy kernel only (the tests run both).
USE_COMPILED = True


@functools.lru_cache(maxsize=1)
def _loops() -> Optional[Tuple[Callable, Callable]]:
    """``(forward, backward)`` of ``native/avgpool.c``, or None without the library."""
    pointer, long_, int_ = compiled.POINTER, compiled.LONG, compiled.INT
    args = ([pointer] + [long_] * 3) * 2 + [int_] * 17 + [compiled.FLOAT, pointer]
    forward = compiled.function("cosmotrain_avgpool_forward", args)
    backward = compiled.function("cosmotrain_avgpool_backward", args)
    return None if forward is None or backward is None else (forward, backward)


def applies(array: np.ndarray) -> bool:
    """Whether ``array`` (a numpy input or output gradient) takes the compiled loops."""
    return USE_COMPILED and array.dtype == np.float32 and _loops() is not None


def _geometry(pool) -> list:
    """kernel, stride and padding-before triples, flattened as the loops take them."""
    return [*pool.kernel, *pool.stride, *(lo for lo, _ in pool.padding)]


def forward(x: np.ndarray, pool) -> np.ndarray:
    """``avg_pool3d_forward`` of the C-contiguous float32 ``x`` (``pool``: its _Pool)."""
    loops = _loops()
    assert loops is not None
    y = np.empty(pool.y_shape, np.float32)
    scale = 1.0 / int(np.prod(pool.kernel))
    (do, ho, wo), (d, h, w) = pool.out, pool.x_shape[2:]

    def work(chunk) -> None:
        n, c0, c1 = chunk
        row = _parallel.scratch("avgpool_row", (max(w, wo),), np.float32)
        loops[0](compiled.address(x[n, c0]), *compiled.element_strides(x)[1:4],
                 compiled.address(y[n, c0]), *compiled.element_strides(y)[1:4], c1 - c0,
                 *_geometry(pool), d, h, w, 0, do, ho, wo, scale, compiled.address(row))

    _parallel.map_chunks(work, pool.chunks(x.itemsize))
    return y


def backward(dy: np.ndarray, pool) -> np.ndarray:
    """``avg_pool3d_backward`` of the C-contiguous float32 ``dy``."""
    loops = _loops()
    assert loops is not None
    dx = np.empty(pool.x_shape, np.float32)
    scale = 1.0 / int(np.prod(pool.kernel))
    (do, ho, wo), (d, h, w) = pool.out, pool.x_shape[2:]

    def work(chunk) -> None:
        n, c0, c1 = chunk
        row = _parallel.scratch("avgpool_row", (max(w, wo),), np.float32)
        loops[1](compiled.address(dy[n, c0]), *compiled.element_strides(dy)[1:4],
                 compiled.address(dx[n, c0]), *compiled.element_strides(dx)[1:4], c1 - c0,
                 *_geometry(pool), do, ho, wo, 0, d, h, w, scale, compiled.address(row))

    _parallel.map_chunks(work, pool.chunks(dy.itemsize))
    return dx
