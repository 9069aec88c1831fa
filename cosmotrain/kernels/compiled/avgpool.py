"""Average pooling (zero padding counted) through the compiled loops of
``native/avgpool.c``, for float32 numpy arrays.

Why: :mod:`.pool3d`'s numpy kernel sums windows separably with strided slice operations;
the paper network's first pooling (16 x 128^3 floats a sample) took 30 ms forward and
50 ms backward of its 0.5 s step on the AVX-512 box of 2026-11-27.  The loops make one
pass per output plane (forward) or input plane (backward) with contiguous row sums.

They add in exactly the numpy kernel's order (its whole-volume or plane-by-plane order,
as it would choose, the scaling where it applies it), so the results are its bits
(tests/test_pool3d.py).  That matters beyond tidiness: the spatial layers exchange and
add halo gradients per dimension, and the separable order is what gives one process's
results on every split; a first version that summed the window's rows in another order
was right to float32 rounding on every call yet moved the D2H2 batch-norm runs of
tests/test_hybrid_mpi.py by 1e-2 after three steps.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import library as compiled
from cosmotrain.kernels.leaky_factors import backward_factors

# False: the numpy kernel only (the tests run both).
USE_COMPILED = True
# Input gradients of at least this many bytes are written past the caches: they outgrow
# the last-level cache and the convolution before reads them from memory anyway, and a
# plain store first reads each line it writes.  The paper network's pool1 (134 MB a
# sample): 14.0 -> 9.6 ms (docs/PERFORMANCE.md, "Fifth pass").
STREAM_BYTES = 64 << 20


@functools.lru_cache(maxsize=1)
def _loops() -> Optional[Tuple[Callable, Callable]]:
    """``(forward, backward)`` of ``native/avgpool.c``, or None without the library."""
    pointer, int_ = compiled.POINTER, compiled.INT
    arrays = ([pointer] + [compiled.LONG] * 3) * 2
    sizes = [int_] * 16  # channels, kernel, stride, padding before, input and output
    args = arrays + sizes + [compiled.FLOAT, pointer, int_]
    activation = [pointer] + [compiled.LONG] * 3 + [compiled.FLOAT] * 2
    return compiled.functions(("cosmotrain_avgpool_forward", args, int_),
                              ("cosmotrain_avgpool_backward", args + [int_] + activation, int_))


def applies(array: np.ndarray) -> bool:
    """Whether ``array`` (a numpy input or output gradient) takes the compiled loops."""
    return USE_COMPILED and array.dtype == np.float32 and _loops() is not None


def _geometry(pool) -> list:
    """kernel, stride and padding-before triples, flattened as the loops take them."""
    return [*pool.kernel, *pool.stride, *(lo for lo, _ in pool.padding)]


def forward(x: np.ndarray, pool) -> np.ndarray:
    """``avg_pool3d_forward`` of the C-contiguous float32 ``x`` (``pool``: its PoolGeometry),
    bit for bit the numpy kernel's result."""
    y = np.empty(pool.y_shape, np.float32)
    _run(0, x, y, pool, pool.x_shape[2:] + pool.out, (pool.x_shape[3] + 2) * pool.x_shape[4] + 1)
    return y


def backward(dy: np.ndarray, pool, activation: Optional[tuple] = None) -> np.ndarray:
    """``avg_pool3d_backward`` of the C-contiguous float32 ``dy``: bit for bit the numpy
    kernel's result (its order of additions and of the scaling, whole-volume or plane by
    plane as it would choose), which the spatial layers' halo sums rely on.

    ``activation``: ``(y, slope)`` of a LeakyReLU before the pooling (y float32, the
    pooling's input shape, rows contiguous), whose backward each row then takes as it is
    finished: the bits of :func:`.activation.leaky_relu_backward` after the pooling's, in
    one pass over dx instead of two more."""
    dx = np.empty(pool.x_shape, np.float32)
    stream = int(dx.nbytes >= STREAM_BYTES)
    _run(1, dy, dx, pool, pool.out + pool.x_shape[2:],
         (pool.out[1] + 1) * pool.out[2] + 3 * pool.x_shape[4],
         lambda n, c0: [stream, *_activation_args(activation, n, c0)])
    return dx


def takes_activation(y, pool) -> bool:
    """Whether :func:`backward` can run the backward of the LeakyReLU whose output is
    ``y`` (float32 numpy, the pooling's input shape, rows contiguous)."""
    return (isinstance(y, np.ndarray) and y.dtype == np.float32
            and tuple(y.shape) == tuple(pool.x_shape) and y.strides[-1] == y.itemsize)


def _run(which: int, src: np.ndarray, dst: np.ndarray, pool, sizes: tuple,
         scratch: int, tail: Callable[[int, int], list] = lambda n, c0: []) -> None:
    """The forward (0) or backward (1) loop over ``pool.chunks`` (whole channels of one
    sample) on the kernel workers; ``sizes``: the loop's source then destination (D, H,
    W); ``scratch``: floats of its per-thread row buffer; ``tail(n, c0)``: the loop's
    last arguments for a chunk of sample n from channel c0 (the backward's)."""
    loop = _loops()[which]  # type: ignore[index]
    scale = 1.0 / int(np.prod(pool.kernel))
    whole = int(pool.whole(src.itemsize))

    def work(chunk) -> None:
        n, c0, c1 = chunk
        rows = workers.scratch("avgpool_rows", (scratch,), np.float32)
        compiled.check(loop(compiled.address(src[n, c0]), *compiled.element_strides(src)[1:4],
                            compiled.address(dst[n, c0]), *compiled.element_strides(dst)[1:4],
                            c1 - c0, *_geometry(pool), *sizes, scale, compiled.address(rows),
                            whole, *tail(n, c0)), "average pooling")

    workers.map_chunks(work, pool.chunks(src.itemsize))


def _activation_args(activation: Optional[tuple], n: int, c0: int) -> list:
    """The backward loop's ``ya, ya_c, ya_d, ya_h, up, down`` for sample n from channel
    c0 (a null ``ya`` without an activation)."""
    if activation is None:
        return [None, 0, 0, 0, 0.0, 0.0]
    y, slope = activation
    return [compiled.address(y[n, c0]), *compiled.element_strides(y)[1:4],
            *backward_factors(slope)]
