"""Direct convolution on the CPU through the compiled loops of ``native/direct.c``.

Why: the GEMM lowering (:mod:`.lowering`, :mod:`.depth_lowering`) spends the thin
layers' time in OpenBLAS GEMMs of 16-64 rows, which run at 50-90 GFLOP/s on one AVX-512
core against 152 for large sgemm, and in the copies of the lowering itself; oneDNN runs
the same layers as direct convolutions near the core's peak.  The compiled loops read a
zero-padded slab of input planes row by row and keep a block of filters x output vectors
in registers: no column matrix, no shifted adds.  Measured per layer against the
lowering: ``benchmarks/bench_compiled.py`` and docs/PERFORMANCE.md, "Compiled
convolution and pooling loops".

The library is an optional extension built by ``pip install`` (setup.py) with the
system's C compiler; without it, on a CPU without AVX2 + FMA, or for float64 (the tests'
precision), :func:`available` is False and the numpy kernels run instead.  Calls go
through ``ctypes``, which releases the GIL, so the kernel workers of :mod:`cosmotrain.kernels.cpu.workers`
run chunks on all cores.

Conventions are :mod:`.conv3d`'s (NCDHW, weights ``(F, C, kD, kH, kW)``, asymmetric
padding); these loops need unit stride.  Summation order per output is fixed (channels,
then kernel offsets), so the forward's results do not depend on the chunking or on how
the ranks split the volume.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import library as compiled
from cosmotrain.kernels.leaky_factors import backward_factors
from cosmotrain.kernels.geometry import ConvGeometry, plan_chunks
from cosmotrain.kernels.cpu.lowering import fill_slab

# Output planes per chunk of work (the slab holds planes + kD - 1 input planes).
CHUNK_PLANES = 4
# Forward outputs of at least this many bytes are stored past the caches (AVX-512):
# they outgrow the last-level cache, so the next layer reads them from memory anyway, and
# a plain store first reads each line it writes.  The paper network's conv1 (134 MB a
# sample): 28.6 -> 27.2 ms, the next pooling's read unchanged (2026-11-27, 2 threads).
STREAM_BYTES = 64 << 20

_c_long, _c_int, _ptr = compiled.LONG, compiled.INT, compiled.POINTER
_c_float = compiled.FLOAT
_FORWARD_ARGS = [_ptr, _c_long, _c_long, _c_long, _c_int, _c_int, _c_int, _c_int,
                 _ptr, _c_int, _ptr, _ptr, _c_long, _c_long, _c_long, _c_int, _c_int, _c_int,
                 _c_int, _c_float, _c_int]
_WINOGRAD_ARGS = [_ptr, _ptr, _c_int, _c_int, _c_int,
                  _ptr, _c_int, _ptr, _ptr, _c_long, _c_long, _c_long, _c_int, _c_int, _c_int,
                  _ptr, _c_int, _c_int, _c_float]
_WINOGRAD_FILTER_ARGS = [_ptr, _ptr, _c_int, _c_int, _c_int,
                         _ptr, _c_long, _c_long, _c_long, _c_int, _ptr, _c_int, _c_int, _c_int,
                         _ptr, _c_int, _ptr]
_FILTER_ARGS = [_ptr, _c_long, _c_long, _c_long, _c_int, _c_int, _c_int, _c_int,
                _ptr, _c_long, _c_long, _c_long, _c_int, _ptr, _c_int, _c_int, _c_int, _ptr,
                _ptr, _c_long, _c_long, _c_long, _c_float, _c_float]


@dataclass(frozen=True)
class _Loops:
    """The loops for the running CPU and their register blocking."""

    forward: ctypes._CFuncPtr  # type: ignore[name-defined]
    filter_grad: ctypes._CFuncPtr  # type: ignore[name-defined]
    winograd_forward: ctypes._CFuncPtr  # type: ignore[name-defined]
    winograd_filter_grad: ctypes._CFuncPtr  # type: ignore[name-defined]
    lanes: int        # floats per vector (VL)
    filter_block: int  # filters per register block (FB)
    run: int          # outputs per register block along W (VL * WV)
    isa: str


_ISAS = {"avx512": (2, 16, 8, 2), "avx2": (1, 8, 4, 3)}  # level, VL, FB, WV


@functools.lru_cache(maxsize=None)
def loops_for(isa: str) -> Optional[_Loops]:
    """The loops compiled for ``isa`` ("avx512" or "avx2"), None when this CPU cannot run
    them (the tests run the AVX2 loops on AVX-512 machines too)."""
    lib = compiled.library()
    level, lanes, block, vectors = _ISAS[isa]
    if lib is None or lib.cosmotrain_direct_level() < level:
        return None
    return _Loops(compiled.function(f"cosmotrain_direct_forward_{isa}", _FORWARD_ARGS),
                  compiled.function(f"cosmotrain_direct_filter_grad_{isa}", _FILTER_ARGS,
                                    _c_int),
                  compiled.function(f"cosmotrain_winograd_w_forward_{isa}", _WINOGRAD_ARGS),
                  compiled.function(f"cosmotrain_winograd_w_filter_grad_{isa}",
                                    _WINOGRAD_FILTER_ARGS, _c_int),
                  lanes, block, lanes * vectors, isa)


def active_loops() -> Optional[_Loops]:
    """The widest loops this CPU runs (None: the numpy kernels)."""
    return loops_for("avx512") or loops_for("avx2")


def available() -> bool:
    """Whether the compiled loops were built and run on this CPU."""
    return active_loops() is not None


def instruction_set() -> Optional[str]:
    """``"avx512"``, ``"avx2"`` or None (what ``cosmotrain info`` may report)."""
    loops = active_loops()
    return loops.isa if loops else None


def register_run() -> int:
    """Outputs along W that one register block computes (32 with AVX-512, 24 with AVX2)."""
    loops = active_loops()
    assert loops is not None
    return loops.run


def filter_block() -> int:
    """Filters per register block (8 with AVX-512, 4 with AVX2)."""
    loops = active_loops()
    assert loops is not None
    return loops.filter_block


def describe() -> str:
    """One line for ``cosmotrain info``: which CPU convolution kernels this install runs."""
    loops = active_loops()
    if loops is not None:
        return f"direct loops ({loops.isa}) + GEMM lowerings"
    if compiled.library() is None:
        return "GEMM lowerings only (direct loops not built: reinstall with a C compiler)"
    return "GEMM lowerings only (this CPU lacks AVX2 + FMA)"


def supports(geo: ConvGeometry, dtype) -> bool:
    """Whether these loops can run the convolution: float32, unit stride, compiled."""
    return np.dtype(dtype) == np.float32 and geo.stride == (1, 1, 1) and available()


def pack_weights(w: np.ndarray) -> np.ndarray:
    """``(ceil(F/FB), C, kD, kH, kW, FB)`` float32: the FB weights a register block
    broadcasts for one input tap are adjacent; missing filters of the last block are 0."""
    loops = active_loops()
    assert loops is not None
    fb = loops.filter_block
    f = w.shape[0]
    blocks = -(-f // fb)
    packed = np.zeros((blocks * fb,) + w.shape[1:], np.float32)
    packed[:f] = w
    return np.ascontiguousarray(
        packed.reshape((blocks, fb) + w.shape[1:]).transpose(0, 2, 3, 4, 5, 1))


def slab(geo: ConvGeometry, src_n: np.ndarray, z0: int, z1: int, width: int) -> np.ndarray:
    """Zero-padded ``(C, depth, Hp, width)`` input of output planes z0:z1 (a per-thread
    scratch buffer); ``width`` covers the rows the loops read past the padded input."""
    (dl, _), (hl, _), (wl, _) = geo.padding
    _, depth, hp, _ = geo.slab_shape(z1 - z0)
    buf = workers.scratch("direct_slab", (geo.channels, depth, hp, width), np.float32)
    return fill_slab(buf, src_n, (z0 - dl, -hl, -wl))


def _row_width(geo: ConvGeometry, run: int) -> int:
    """Slab rows for register runs: the output width rounded up to ``run``, plus the
    kernel."""
    return -(-geo.out[2] // run) * run + geo.kernel[2] - 1


def forward(x: np.ndarray, w: np.ndarray, geo: ConvGeometry, y: np.ndarray,
            bias: Optional[np.ndarray] = None, slope: Optional[float] = None) -> np.ndarray:
    """``y = conv(x, w) + bias`` (float32, unit stride) into the C-contiguous ``y``, then
    LeakyReLU(``slope``) unless ``slope`` is None (each register run while in cache)."""
    loops = active_loops()
    assert loops is not None and supports(geo, x.dtype)
    packed = pack_weights(w)
    kd, kh, kw = geo.kernel
    _, ho, wo = geo.out
    bias_ptr = compiled.address(bias) if bias is not None else None
    fs, ds, hs = compiled.element_strides(y)[1:4]
    stream = int(y.nbytes >= STREAM_BYTES)

    def work(chunk) -> None:
        n, z0, z1 = chunk
        block = slab(geo, x[n], z0, z1, _row_width(geo, loops.run))
        sc, sd, sh = compiled.element_strides(block)[:3]
        loops.forward(compiled.address(block), sc, sd, sh, geo.channels, kd, kh, kw,
                      compiled.address(packed), geo.filters, bias_ptr,
                      compiled.address(y[n, :, z0]), fs, ds, hs, z1 - z0, ho, wo,
                      slope is not None, 0.0 if slope is None else slope, stream)

    workers.map_chunks(work, plan_chunks(geo.batch, geo.out[0], CHUNK_PLANES))
    return y


def filter_grad(x: np.ndarray, dy: np.ndarray, geo: ConvGeometry,
                activation: Optional[tuple[np.ndarray, float]] = None) -> np.ndarray:
    """``dL/dw`` ``(F, C, kD, kH, kW)`` float32 (unit stride); chunk partials are summed
    in chunk order.  ``activation``: see :func:`filter_and_bias_grad`."""
    return filter_and_bias_grad(x, dy, geo, bias=False, activation=activation)[0]


def packs_activation(geo: ConvGeometry) -> bool:
    """Whether the filter gradient can multiply dy by an activation's factor as it packs
    it: dy's rows are read in place (whole vectors), not copied into padded rows."""
    loops = active_loops()
    return loops is not None and geo.out[2] % loops.lanes == 0


def filter_and_bias_grad(x: np.ndarray, dy: np.ndarray, geo: ConvGeometry, bias: bool = True,
                         activation: Optional[tuple[np.ndarray, float]] = None
                         ) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(dL/dw, dL/db)``: the filter gradient and, when ``bias``, the per-filter sums of
    ``dy`` (float32; None otherwise), taken from the loops' packed dy tiles while they
    are in cache rather than in a pass over dy of their own; partials in chunk order.

    ``activation``: ``(y, slope)`` of a LeakyReLU after this layer, whose backward the
    packing then runs (dy times its factor of y, the bits of its own pass,
    :func:`.activation.leaky_relu_backward`); y float32, laid out as dy, and
    :func:`packs_activation` true."""
    loops = active_loops()
    assert loops is not None and supports(geo, x.dtype)
    kd, kh, kw = geo.kernel
    _, ho, wo = geo.out
    padded_w = -(-wo // loops.lanes) * loops.lanes

    up, down = backward_factors(activation[1]) if activation is not None else (0.0, 0.0)
    assert activation is None or (packs_activation(geo) and activation[0].shape == dy.shape)

    def work(chunk) -> np.ndarray:
        n, z0, z1 = chunk
        block = slab(geo, x[n], z0, z1, _row_width(geo, loops.run))
        grad = dy[n, :, z0:z1]
        ya = activation[0][n, :, z0:z1] if activation is not None else None
        ys = compiled.element_strides(ya)[:3] if ya is not None else (0, 0, 0)
        if padded_w != wo:  # the loops read whole vectors: zeros past the row's end
            rows = workers.scratch("direct_dy", grad.shape[:3] + (padded_w,), np.float32)
            rows[..., wo:] = 0
            rows[..., :wo] = grad
            grad = rows
        sc, sd, sh = compiled.element_strides(block)[:3]
        fs, ds, hs = compiled.element_strides(grad)[:3]
        part = np.zeros(size + (geo.filters if bias else 0), np.float32)
        compiled.check(loops.filter_grad(
            compiled.address(block), sc, sd, sh, geo.channels, kd, kh, kw,
            compiled.address(grad), fs, ds, hs, geo.filters,
            compiled.address(part), z1 - z0, ho, wo,
            compiled.address(part[size:]) if bias else None,
            compiled.address(ya) if ya is not None else None, *ys, up, down),
            "direct filter gradient")
        return part

    size = int(np.prod(geo.w_shape))
    total = workers.sum_in_order(
        workers.map_chunks(work, plan_chunks(geo.batch, geo.out[0], CHUNK_PLANES)))
    return total[:size].reshape(geo.w_shape), total[size:] if bias else None
