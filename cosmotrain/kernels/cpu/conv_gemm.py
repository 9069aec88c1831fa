"""3D convolution on the CPU by GEMM lowerings (numpy + BLAS), forward and gradients.

Algorithms.  float32 unit-stride layers may take compiled loops, by the rules of
:mod:`.compiled_choice`: Winograd F(2,3) / F(4,3) along W (:mod:`.winograd`) for the wider
3-wide layers, the direct convolution (:mod:`.direct`) for layers whose rows fill its
register runs, each for the forward, the filter gradient and the data gradient (the
forward of the flipped kernel).  On the AVX-512 box of 2026-11-27 they ran the CosmoFlow
layers 1.2-2.8x faster than the lowerings below, whose GEMMs of 16-64 rows OpenBLAS runs
at a third to a half of its sgemm rate.  Everything else (float64, strides, small planes,
installs without the compiled library) takes the chunked GEMM lowering
(:mod:`.lowering`).

* forward:  ``y = W @ cols``, W split (``kW`` shifted adds) when its stride is 1; thin
  layers (few input channels, large planes: :func:`_thin`) lower (H, W) once per input
  plane and the depth by views instead (:mod:`.depth_lowering`: no shifted adds);
* wgrad:    ``dW = dy_shifted @ cols^T`` with the forward's lowering;
* dgrad:    unit stride: dx is the convolution of dy (padded by ``k-1-lo``, ``k-1-hi``)
  with the flipped, transposed kernel, lowered with H and W split: a gather, with no
  column copies, zero fill or read-modify-write of dx (conv 4->16 at 128^3: 62 ms,
  against 137 ms for GEMM + col2im).  Other strides scatter with col2im
  (:mod:`.conv3d_dgrad`); so may, with :data:`DGRAD_SCATTER`, unit-stride layers too
  small to split whose F exceeds C.

Winograd with numpy passes for the transforms and these kernels for the GEMMs
(``benchmarks/winograd_study.py``, 2026-11-23) measured 0.9-1.4x; in compiled loops
(:mod:`.winograd`, 2026-11-27) F(2,3) and F(4,3) along W run MLPerf conv2-conv4
1.1-1.6x faster than the direct loops or the lowerings.

Layout decision ("NCDHW or channels-last: choose by measurement").  Measured with
``benchmarks/bench_conv_layout.py`` (forward, W=128 CosmoFlow layers, batch 1, 2-core
Zen5, numpy 2.4 / OpenBLAS 0.3.31, same chunking and worker pool, best of 3 x 7 runs):
this module against a channels-last prototype (slabs transposed to (d, h, w, C), column
matrix (n, 27*C) copied in runs of kW*C floats, GEMM (n, K) @ (K, F), result transposed
back into NCDHW).

    layer           OpenBLAS default (Haswell kernels)   OPENBLAS_CORETYPE=SkylakeX
                    NCDHW     channels-last              NCDHW     channels-last
    conv1 4->16      62 ms    121 ms  (1.95x)             49 ms    107 ms  (2.2x)
    conv2 16->32     46 ms     66 ms  (1.44x)             31 ms     45 ms  (1.5x)
    conv3 32->64     21 ms     21 ms  (1.04x)             12 ms     14 ms  (1.15x)

Channels-last loses on the thin, memory-bound layers that hold 78% of the FLOPs: its
copies move runs of 12 floats (conv1) instead of rows of 128 and it needs transposes in
and out (the prototype also lacks the W split, whose GEMM shape is better; see
:mod:`.lowering`).  The kernels stay NCDHW.
(OpenBLAS picks its AVX2 "Haswell" kernels on this Zen5; ``OPENBLAS_CORETYPE=SkylakeX``,
set before numpy is imported, makes every layer 1.3-1.7x faster.)
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from cosmotrain.kernels.cpu import depth_lowering, workers
from cosmotrain.kernels.cpu.conv_dgrad import backward_data_scatter
from cosmotrain.kernels.cpu.lowering import Lowering, planes_view
from cosmotrain.kernels.geometry import ConvGeometry, plan_chunks

# Chunks (units of work for the worker pool) per sample: enough to balance two workers.
CHUNKS_PER_SAMPLE = 8
# Buffers of one GEMM's column matrix and output (bytes); flat from 0.5 to 8 MiB here.
CHUNK_BYTES = 4 << 20
# Padded input slab of one chunk (bytes): larger slabs copy fewer shared planes twice.
SLAB_BYTES = 16 << 20
# Fewest GEMM columns per chunk; below this one BLAS-threaded GEMM beats parallel chunks.
MIN_COLUMNS = 4096
# Dimensions the data gradient's gather may split (H and W: no column copies).
DGRAD_MAX_SHIFT = 2
# Unit-stride data gradients that no split fits (small planes) may scatter (col2im) when
# F > C: the gather's column matrix has F*27 rows, col2im's C*27, and the gather needs
# the flipped kernel transposed first.  Off: on MLPerf conv4 / conv5 (F = 2C, 16^3 and
# 8^3) the two measured within the box's noise, either ahead by up to 20% from run to run
# (docs/PERFORMANCE.md, "cosmoflow-mlperf per layer against PyTorch", 2026-11-23).
DGRAD_SCATTER = False
# Column matrix of one col2im chunk of the data gradient (bytes): 4 MiB cut conv5's
# sample into 2-plane GEMMs (128 columns); 16 MiB was the best of 4 / 16 / 64 MiB in
# two (noisy) runs.
SCATTER_BYTES = 16 << 20
# Unit-stride data gradients of at most this many output positions per sample scatter
# whatever F and C: the gather's weights are a flipped, transposed copy of the whole
# kernel (7 MB for 256 x 256 x 3^3), which outweighs a GEMM over 8-64 positions.  2026-11-27,
# median ms, gather against scatter, 2 / 1 threads: 256->256 at 2^3 2.33 / 1.84 against
# 1.11 / 1.15; 128->256 at 4^3 2.45 / 2.44 against 1.63 / 1.91; 256->512 at 4^3 7.2 / 8.3
# against 3.9 / 5.7; at 8^3 the two are level (256->512) or the gather ahead (128->256).
SCATTER_MAX_OUTPUTS = 64
# Fewest GEMM columns per GEMM (a group of planes), even past ``CHUNK_BYTES``: plain
# im2col on 16^3 and 8^3 planes got 256 or 64-128 columns within 4 MiB, where OpenBLAS
# packs the weights for little work (1 thread: 512x6912 @ N=128 81, N=1024 93 GFLOP/s;
# 256x13824 @ N=64 74, N=1024 90).  MLPerf batch 2, old and new interleaved (medians,
# 2026-11-23): conv5 forward 55 -> 45 ms, conv4 forward 110 -> 98 ms (512: 98 ms too).
MIN_GEMM_COLUMNS = 1024
# A split lowering extends the GEMM grid by k-1; allowed while that is <= 1/16 of it.
MAX_SPLIT_WASTE = 1 / 16
# The depth-window lowering (:mod:`.depth_lowering`) is for thin layers, whose time is
# copies and shifted adds rather than GEMMs: at most this many input channels (conv 4->32
# at 128^3: forward 1.5x, filter gradient 1.7x faster; with 32 or 64 channels it measured
# even in the forward and up to 1.4x slower in the filter gradient, whose GEMMs then
# reduce over one row block only) ...
MAX_WINDOW_CHANNELS = 16
# ... and at least this many outputs per plane (its GEMMs are a row block wide).
MIN_WINDOW_PLANE = 1024


def choose_lowering(geo: ConvGeometry, max_shift: int) -> Lowering:
    """Split as many trailing dims (<= max_shift) as have unit stride and little waste."""
    for shift in range(max_shift, 0, -1):
        dims = range(3 - shift, 3)
        if all(geo.stride[d] == 1 and 1 < geo.kernel[d] <= 1 + geo.out[d] * MAX_SPLIT_WASTE
               for d in dims):
            return Lowering(geo, shift)
    return Lowering(geo, 0)


def _thin(geo: ConvGeometry) -> bool:
    """Whether the forward and filter gradient take the depth-window lowering."""
    return geo.channels <= MAX_WINDOW_CHANNELS and geo.plane >= MIN_WINDOW_PLANE


def _chunks(low: Lowering, itemsize: int):
    """Chunks of output planes: about ``CHUNKS_PER_SAMPLE`` per sample, each with at least
    ``MIN_COLUMNS`` GEMM columns (smaller GEMMs do better as one BLAS-threaded call), and
    at most ``SLAB_BYTES`` of padded input slab."""
    geo = low.geo
    slab_plane = geo.channels * int(np.prod(geo.slab_shape(1)[2:])) * geo.stride[0] * itemsize
    cap = max(1, SLAB_BYTES // slab_plane - geo.kernel[0])
    planes = max(-(-geo.out[0] // CHUNKS_PER_SAMPLE), -(-MIN_COLUMNS // low.columns_per_plane))
    return plan_chunks(geo.batch, geo.out[0], min(cap, planes))


def _columns(low: Lowering, src: np.ndarray, chunk):
    """``(g0, g1, column matrix)`` for the groups of planes of one chunk, in order.

    A group is lowered by one GEMM; its buffers (columns, and GEMM output or shifted
    gradient for split lowerings) take about ``CHUNK_BYTES``.
    """
    n, z0, z1 = chunk
    slab = low.slab(src[n], z0, z1)
    per_plane = (low.rows + (low.outputs if low.shift else 0)) * low.columns_per_plane
    size = 1 if low.shift == 2 else max(CHUNK_BYTES // (per_plane * src.itemsize),
                                        -(-MIN_GEMM_COLUMNS // low.columns_per_plane), 1)
    for g0 in range(z0, z1, size):
        g1 = min(z1, g0 + size)
        yield g0, g1, low.columns(slab, g0 - z0, g1 - g0)


def _run_lowered(src: np.ndarray, wmat: np.ndarray, low: Lowering, y: np.ndarray,
                 bias: Optional[np.ndarray] = None) -> np.ndarray:
    """``y = conv(src) (+ bias)`` for the lowering ``low`` and its weight matrix ``wmat``."""
    def work(chunk):
        n = chunk[0]
        for g0, g1, cols in _columns(low, src, chunk):
            if low.shift == 0:
                np.matmul(wmat, cols, out=planes_view(y[n], g0, g1))
            else:
                t = workers.scratch("gemm_out", (low.outputs, cols.shape[1]), src.dtype)
                np.matmul(wmat, cols, out=t)
                low.sum_shifts(t, y[n, :, g0:g1])
            if bias is not None:  # while the group's output is in cache
                block = y[n, :, g0:g1]
                np.add(block, bias.reshape(-1, 1, 1, 1), out=block)

    workers.map_chunks(work, _chunks(low, src.itemsize))
    return y


def forward(x: np.ndarray, w: np.ndarray, geo: ConvGeometry, y: np.ndarray,
            bias: Optional[np.ndarray]) -> np.ndarray:
    """``y = conv(x, w) (+ bias)`` by depth windows (thin layers) or a lowering."""
    if _thin(geo):
        win = depth_lowering.DepthWindows(geo)
        return depth_lowering.forward(x, win.weights(w), win, y, bias)
    low = choose_lowering(geo, max_shift=1)
    return _run_lowered(x, low.weights(w), low, y, bias)


def filter_grad(x: np.ndarray, dy: np.ndarray, geo: ConvGeometry) -> np.ndarray:
    """The filter gradient by the GEMM lowerings (depth windows for thin layers)."""
    if _thin(geo):
        return depth_lowering.filter_grad(x, dy, depth_lowering.DepthWindows(geo))
    low = choose_lowering(geo, max_shift=1)

    def work(chunk):
        n, total = chunk[0], None
        for g0, g1, cols in _columns(low, x, chunk):
            grad = (planes_view(dy[n], g0, g1) if low.shift == 0
                    else low.spread_shifts(dy[n, :, g0:g1]))
            part = np.matmul(grad, cols.T)
            total = part if total is None else np.add(total, part, out=total)
        return total

    g = workers.sum_in_order(workers.map_chunks(work, _chunks(low, x.itemsize)))
    return np.ascontiguousarray(low.weights_from_matrix(g))


def scatters(geo: ConvGeometry) -> bool:
    """Whether the data gradient must scatter (col2im): strided, or padding as wide as
    the kernel, which the gather's transposed convolution cannot express."""
    fits = all(lo < k and hi < k for (lo, hi), k in zip(geo.padding, geo.kernel))
    return geo.stride != (1, 1, 1) or not fits


def transposed(w: np.ndarray, geo: ConvGeometry, dy_shape) -> tuple[np.ndarray, ConvGeometry]:
    """``(flipped kernel, its geometry)``: dx = conv(dy padded by k-1-lo / k-1-hi, the
    flipped kernel with C and F swapped)."""
    flipped = w[:, :, ::-1, ::-1, ::-1].transpose(1, 0, 2, 3, 4)
    pad_t = tuple((k - 1 - lo, k - 1 - hi) for (lo, hi), k in zip(geo.padding, geo.kernel))
    return flipped, ConvGeometry.create(dy_shape, flipped.shape, 1, pad_t)


def data_grad(dy: np.ndarray, w: np.ndarray, geo: ConvGeometry, dx: np.ndarray) -> np.ndarray:
    """``dx`` by col2im where the gather does not apply or does not pay, else the gather."""
    if scatters(geo):
        return backward_data_scatter(dy, w, geo, CHUNK_BYTES, dx)
    flipped, tgeo = transposed(w, geo, dy.shape)
    low = choose_lowering(tgeo, max_shift=DGRAD_MAX_SHIFT)
    tiny = int(np.prod(geo.out)) <= SCATTER_MAX_OUTPUTS
    if low.shift == 0 and (tiny or DGRAD_SCATTER and geo.filters > geo.channels):
        return backward_data_scatter(dy, w, geo, SCATTER_BYTES, dx)
    return _run_lowered(dy, low.weights(flipped), low, dx)
