"""Fused SGD-momentum and Adam updates through the compiled loops of ``native/optim.c``.

Why: ``engine/optim.py``'s numpy update makes about ten passes over each parameter, its
gradient and its state on one core; on the paper network (9.4M parameters) Adam took
45 ms of a 0.38 s step (2026-11-27).  The loops make one pass, on the kernel workers,
with numpy's operations and roundings in the same order (no fused multiply-adds):
the results are bit for bit those of the numpy update, which are torch.optim's
(tests/test_optim.py runs both).  Used for C-contiguous float32 numpy arrays when the
compiled library was built; otherwise these functions return False and the caller runs
its numpy update.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import library as compiled

# Elements per chunk handed to a worker; smaller arrays are updated in one call.
CHUNK_ELEMENTS = 1 << 18
# False: the numpy updates only (the tests run both).
USE_COMPILED = True


@functools.lru_cache(maxsize=1)
def _loops() -> Optional[tuple]:
    """``(adam, sgd_momentum)`` of ``native/optim.c``, or None without the library."""
    p, n, f = compiled.POINTER, compiled.LONG, compiled.FLOAT
    return compiled.functions(("cosmotrain_adam_update", [p, p, p, p, n] + [f] * 7),
                              ("cosmotrain_sgd_momentum_update", [p, p, p, n, f, f]))


def _usable(*arrays: np.ndarray) -> bool:
    if not USE_COMPILED or _loops() is None:
        return False
    shape = arrays[0].shape
    return all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == shape
               and a.flags.c_contiguous for a in arrays)


def _run(call: Callable[[int, int], None], size: int) -> None:
    """``call(start, count)`` over ``size`` elements, in chunks on the workers."""
    if size <= CHUNK_ELEMENTS:
        call(0, size)
        return
    starts = list(range(0, size, CHUNK_ELEMENTS))
    workers.map_chunks(lambda s: call(s, min(CHUNK_ELEMENTS, size - s)), starts)


def adam(data: np.ndarray, grad: np.ndarray, m: np.ndarray, v: np.ndarray, beta1: float,
         beta2: float, eps: float, bias2_sqrt: float, step_size: float) -> bool:
    """One Adam update in place (constants as the numpy update rounds them to float32);
    False, doing nothing, when the arrays do not qualify."""
    if not _usable(data, grad, m, v):
        return False
    loop = _loops()[0]  # type: ignore[index]
    f32 = np.float32
    consts = [float(f32(c)) for c in (beta1, 1 - beta1, beta2, 1 - beta2, bias2_sqrt, eps,
                                      step_size)]
    flat = [a.reshape(-1) for a in (data, grad, m, v)]

    def call(start: int, count: int) -> None:
        loop(*(compiled.address(a[start:]) for a in flat), count, *consts)

    _run(call, data.size)
    return True


def sgd_momentum(data: np.ndarray, grad: np.ndarray, buf: np.ndarray, momentum: float,
                 lr: float) -> bool:
    """``buf = buf * momentum + grad; data -= buf * lr`` in place; False when the arrays
    do not qualify."""
    if not _usable(data, grad, buf):
        return False
    loop = _loops()[1]  # type: ignore[index]
    consts = [float(np.float32(momentum)), float(np.float32(lr))]
    flat = [a.reshape(-1) for a in (data, grad, buf)]

    def call(start: int, count: int) -> None:
        loop(*(compiled.address(a[start:]) for a in flat), count, *consts)

    _run(call, data.size)
    return True
