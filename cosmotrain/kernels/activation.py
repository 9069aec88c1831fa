"""LeakyReLU, in place and in cache-sized chunks.

In place: the backward pass needs only the sign, which the output keeps, so the
convolution's output buffer becomes the activation's output and is the only tensor kept.
Chunked: ``max(x, slope * x)`` (valid for 0 <= slope <= 1) over 64 Ki-element pieces with
one small scratch buffer runs ~20x faster than a masked multiply over the whole tensor
(measured on a 16 x 128^3 activation: 8.5 ms against 181 ms), because every pass stays in L2.
Masked ufuncs (``where=``) are avoided: on random signs they run ~10x slower than the
equivalent arithmetic (backward: 18 ms against 180 ms).

Contiguous arrays of at least ``PARALLEL_MIN`` elements are cut into one run per
kernel worker (:mod:`cosmotrain.kernels.cpu.workers`; numpy releases the GIL), each done in the same chunks:
same arithmetic, same results.  On one core the passes ran 2.3x slower than PyTorch's
threaded ones on the MLPerf network's first activation (2 x 32 x 128^3).

Contiguous float32 arrays take compiled loops instead when the install built them
(``native/activation.c``: one vectorised pass, the same arithmetic and bits; the tests
run both): on the paper network's act1 at batch 1, forward 13 -> 5 ms, backward 23 -> 9 ms.

Contiguous float32 and bfloat16 cupy arrays take our CUDA kernels
(``kernels/cuda/src/epilogue.cu``, :func:`device_kernel`), in place, bf16 read and written
as stored with float32 arithmetic: the CPU's bits in float32 (the backward's factors of
:mod:`.leaky_factors`), one rounding in bf16.  Other cupy arrays (a halo buffer's strided
owned planes, float64) take one fused element-wise kernel each way (:mod:`.cuda.fused`),
bf16 widened first.  bfloat16 numpy arrays are computed in float32 and rounded back (then
not in place: a new bf16 array is returned, which is what the layers use).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import library as compiled
from cosmotrain.kernels.leaky_factors import backward_factors
from cosmotrain.kernels.cuda import fused, raw_ops
from cosmotrain.kernels.route import route
from cosmotrain.precision import narrow, widen

CHUNK = 1 << 16
# Fewest elements for which the workers share a pass.
PARALLEL_MIN = 1 << 20
# False: the numpy passes only (the tests run both).
USE_COMPILED = True


@functools.lru_cache(maxsize=1)
def _loops() -> Optional[tuple]:
    """``(forward, backward)`` of ``native/activation.c``, or None without the library."""
    p, n, f = compiled.POINTER, compiled.LONG, compiled.FLOAT
    return compiled.functions(("cosmotrain_leaky_relu_forward", [p, n, f]),
                              ("cosmotrain_leaky_relu_backward", [p, p, n, f, f]))


def _compiled(*arrays: Any) -> Optional[tuple]:
    if not USE_COMPILED or not all(isinstance(a, np.ndarray) and a.dtype == np.float32
                                   and a.flags.c_contiguous for a in arrays):
        return None
    return _loops()


def _chunks(*arrays: Any) -> Iterator[tuple[Any, ...]]:
    """Matching pieces of same-shape arrays, views (writes land in the arrays).

    Contiguous arrays: runs of ``CHUNK`` elements.  Otherwise (a halo buffer's owned
    planes, which a strided view cannot flatten without a copy): blocks of whole trailing
    sub-arrays, up to ``CHUNK`` elements and at least one trailing 2-D slab.  One slab per
    piece made the backward a Python loop of tiny slabs: D2's ``act3`` (W = 64, batch 8: 1 M
    elements in 16 x 16 slabs) took 15 ms, now 0.8 ms.
    """
    if all(a.flags.c_contiguous for a in arrays):
        flats = [a.reshape(-1) for a in arrays]
        for start in range(0, flats[0].size, CHUNK):
            yield tuple(f[start:start + CHUNK] for f in flats)
        return
    shape = arrays[0].shape
    lead = max(len(shape) - 2, 0)  # split the dimensions before ``lead``, keep the rest
    while lead > 0 and math.prod(shape[lead - 1:]) <= CHUNK:
        lead -= 1
    if lead == 0:
        yield arrays
        return
    step = max(CHUNK // math.prod(shape[lead:]), 1)  # sub-arrays of dimension lead - 1
    for index in np.ndindex(shape[:lead - 1]):
        for start in range(0, shape[lead - 1], step):
            yield tuple(a[index + (slice(start, start + step),)] for a in arrays)


def _check_slope(slope: float) -> None:
    if not 0.0 <= slope <= 1.0:
        raise ValueError(f"LeakyReLU slope must be in [0, 1], got {slope}")


def device_kernel(*arrays: Any) -> bool:
    """Whether our CUDA kernels take these device arrays: C-contiguous, all float32 or
    all bfloat16 (the storage dtypes of ``src/*.cu``)."""
    names = {a.dtype.name for a in arrays}
    return (len(names) == 1 and names <= {"float32", "bfloat16"}
            and all(a.flags.c_contiguous for a in arrays))


def bias_leaky_relu(y: Any, bias: Any, slope: Optional[float]) -> Any:
    """The convolution epilogue off the CPU's float path: ``y + bias`` (``bias`` float32
    or its bf16 copy, or None) then LeakyReLU with ``slope`` (None: none), in place.  One launch of
    ``epilogue.cu`` where :func:`device_kernel` takes the device array ``y`` (no
    activation is slope 1: ``v > 0 ? v : v * 1`` is ``v``, NaN and -0 included);
    otherwise the bias added in ``y``'s dtype, then :func:`leaky_relu_forward`."""
    if slope is not None:
        _check_slope(slope)
    if (bias is not None or slope is not None) and route(y).device and device_kernel(y):
        if bias is not None and bias.dtype.name != "float32":  # bf16's rounded copy: exact
            bias = bias.astype(np.float32)
        return raw_ops.bias_leaky_relu(y, bias, 1.0 if slope is None else slope, out=y)
    if bias is not None:
        y += bias.astype(y.dtype, copy=False).reshape(1, -1, 1, 1, 1)
    return y if slope is None else leaky_relu_forward(y, slope)


def leaky_relu_forward(x: Any, slope: float, inplace: bool = True) -> Any:
    """``max(x, slope * x)``; overwrites ``x`` when ``inplace``."""
    _check_slope(slope)
    where = route(x)
    if where.device and device_kernel(x):
        return raw_ops.bias_leaky_relu(x, None, slope, out=x if inplace else None)
    if where.bf16:
        return narrow(leaky_relu_forward(widen(x), slope, inplace=False))
    xp = array_module(x)
    y = x if inplace and x.flags.c_contiguous else xp.array(x, order="C", copy=True)
    if where.device:
        return fused.leaky_relu_forward(y, slope, y)
    factor = y.dtype.type(slope)
    loops = _compiled(y)
    if loops is not None:
        _in_runs(lambda piece: loops[0](compiled.address(piece), piece.size, float(factor)), y)
        return y

    def run(*arrays: Any) -> None:
        scratch = workers.scratch("leaky_fwd", (min(CHUNK, arrays[0].size),), y.dtype)
        for (piece,) in _chunks(*arrays):
            part = scratch[:piece.size]
            np.multiply(piece, factor, out=part)
            np.maximum(piece, part, out=piece)

    _in_runs(run, y)
    return y


def _in_runs(run: Any, *arrays: Any) -> None:
    """``run(*pieces)`` over the arrays: on the workers, one run each, when the arrays are
    contiguous and large; else on the whole arrays in the calling thread."""
    count = workers.num_workers()
    size = arrays[0].size
    if count < 2 or size < PARALLEL_MIN or not all(a.flags.c_contiguous for a in arrays):
        run(*arrays)
        return
    flats = [a.reshape(-1) for a in arrays]
    step = -(-size // (count * CHUNK)) * CHUNK  # whole chunks per run
    workers.map_chunks(lambda start: run(*(f[start:start + step] for f in flats)),
                         list(range(0, size, step)))


def leaky_relu_backward(dy: Any, y: Any, slope: float, inplace: bool = True) -> Any:
    """dx = dy where y > 0 else slope * dy (valid for slope > 0 and for slope = 0).

    In place also on a strided ``dy`` (a halo buffer's owned planes)."""
    _check_slope(slope)
    where = route(dy)
    if where.device and device_kernel(dy, y):
        return raw_ops.leaky_relu_backward(dy, y, slope, out=dy if inplace else None)
    if where.bf16:
        return narrow(leaky_relu_backward(widen(dy), widen(y), slope, inplace=False))
    xp = array_module(dy)
    dx = dy if inplace else xp.array(dy, order="C", copy=True)
    factor = dx.dtype.type(slope)
    if where.device:
        return fused.leaky_relu_backward(dx, y, slope, dx)
    loops = _compiled(dx, y)
    if loops is not None:
        up, down = backward_factors(slope, dx.dtype)
        _in_runs(lambda grad, out: loops[1](compiled.address(grad), compiled.address(out),
                                            grad.size, up, down), dx, y)
        return dx
    size = max(CHUNK, dx.shape[-1] * dx.shape[-2] if dx.ndim >= 2 else 0)

    def run(grad: Any, out: Any) -> None:
        scale = workers.scratch("leaky_scale", (min(size, grad.size),), grad.dtype)
        positive = workers.scratch("leaky_sign", (min(size, grad.size),), bool)
        for piece, sign in _chunks(grad, out):
            part = scale[:piece.size].reshape(piece.shape)
            mask = positive[:piece.size].reshape(piece.shape)
            np.greater(sign, 0, out=mask)
            part[...] = mask  # arithmetic, not a masked copy: 10x faster on random signs
            part *= 1 - factor
            part += factor
            piece *= part

    _in_runs(run, dx, y)
    return dx
