"""Winograd F(2,3) and F(4,3) along W for unit-stride 3-wide convolutions (compiled).

Why: on the wider layers (32-512 channels) the direct loops and the GEMM lowerings both
run near the core's FMA rate, and so does oneDNN; only fewer multiplications go past it.
F(m,3) along W computes m outputs of a row from a tile of m + 2 inputs with m + 2
products instead of 3m: F(2,3) 1.5x fewer, F(4,3) 2x fewer.  Along W only, the data
expands by (m + 2) / m (2x, 1.5x) rather than 4x or 8x as in F(2x2,3x3) /
F(2x2x2,3x3x3), and the transforms stay a small part of the time
(``benchmarks/winograd_study.py`` measured the numpy forms, docs/PERFORMANCE.md).

The loops (``cosmotrain_winograd_w_forward_*`` in ``native/winograd_body.h``) transform
a chunk's zero-padded slab into its m + 2 component planes, convolve each over (C, D, H)
with the transformed kernel in the direct loops' register blocks, and write the output
transform (F(2,3): ``y0 = m0 + m1 + m2``, ``y1 = m1 - m2 - m3``) into the output rows,
a vector of tiles at a time interleaved into whole runs of outputs (one tile at a time
in scalar code it took a quarter of the paper network's conv2 forward: 26.4 -> 22.4 ms,
data gradient 33.5 -> 31.2, conv3 10.4 -> 9.2 / 12.3 -> 11.4, 2 threads, 2026-11-27).
The data gradient of a unit-stride layer is the forward of the flipped kernel, so it
takes the same loops; the filter gradient has its own F(2,3) and F(4,3) forms.  Which tile, and
whether Winograd at all: :mod:`.compiled_choice`.

Accuracy: F(2,3)'s transforms add and subtract (coefficients 1 and 1/2), F(4,3)'s scale
by up to 8 and 1/24: float32 results agree with the float64 convolution to 1e-7-1e-6
(F(2,3)) and 1e-6-3e-6 (F(4,3)) of the outputs' scale (tests/test_direct_conv.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import library as compiled, direct
from cosmotrain.kernels.geometry import ConvGeometry, plan_chunks

# Outputs (tiles) a chunk of the filter gradient should hold: its component sums run over
# the chunk's planes, and a few short planes pay their per-sum costs for little work
# (MLPerf conv4, 16^3, one core: 46 ms with 4 planes a chunk, 34 with 8; conv5 51 / 30).
GRAD_CHUNK_TILES = 1024

# G: the taps (g0, g1, g2) of a kernel row become one per component.  F(2,3) (points 0,
# 1, -1, infinity) and F(4,3) (0, 1, -1, 2, -2, infinity; Lavin and Gray's matrices).
_G = {2: np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]]),
      4: np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                   [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1.0]])}


def supports(geo: ConvGeometry, dtype) -> bool:
    """float32, unit stride, kernel width 3, and the compiled loops present."""
    return geo.kernel[2] == 3 and direct.supports(geo, dtype)


# The weight transform in C (native/winograd_weights.c) when the library is built (False:
# the numpy form below only; the tests compare the two).
USE_COMPILED_WEIGHTS = True


@functools.lru_cache(maxsize=1)
def _weights_loop():
    return compiled.function("cosmotrain_winograd_weights",
                             [compiled.POINTER, compiled.INT, compiled.LONG, compiled.INT,
                              compiled.INT, compiled.POINTER])


def transformed_weights(w: np.ndarray, filter_block: int, tile: int = 2) -> np.ndarray:
    """``(tile + 2, ceil(F/FB), C, kD, kH, FB)`` float32: each component's kernel of
    F(tile, 3), packed as the register blocks read it (missing filters are 0).

    Computed in float64 and rounded, in one compiled pass when the library is built:
    numpy's form took 16-32 ms a call for MLPerf conv5's 3.5 M weights on one core."""
    if tile not in _G:
        raise ValueError(f"Winograd tiles are 2 or 4, got {tile}")
    loop = _weights_loop() if USE_COMPILED_WEIGHTS else None
    if loop is None or w.shape[4] != 3:
        return _transformed_weights_numpy(w, filter_block, tile)
    source = np.ascontiguousarray(w, np.float32)
    f, c, kd, kh, _ = w.shape
    blocks = -(-f // filter_block)
    out = np.empty((tile + 2, blocks, c, kd, kh, filter_block), np.float32)
    loop(compiled.address(source), f, c * kd * kh, filter_block, tile, compiled.address(out))
    return out


def _transformed_weights_numpy(w: np.ndarray, filter_block: int, tile: int) -> np.ndarray:
    u = np.tensordot(_G[tile], np.asarray(w, np.float64), axes=([1], [4]))  # (m+2, F, C, ..)
    f, parts = w.shape[0], tile + 2
    blocks = -(-f // filter_block)
    packed = np.zeros((parts, blocks * filter_block) + u.shape[2:], np.float32)
    packed[:, :f] = u
    packed = packed.reshape((parts, blocks, filter_block) + u.shape[2:])
    return np.ascontiguousarray(packed.transpose(0, 1, 3, 4, 5, 2))


# A sample with at most this many register runs of output tiles in all its planes is
# split among the workers by filters rather than by planes: its chunks of planes would
# each transform kD - 1 extra input planes and read every transformed weight (MLPerf
# conv5, 8^3 x 256 channels: 19 MB a chunk), where a filter group transforms the few
# planes again (0.4 M floats) and reads only its own weights.
FILTER_SPLIT_RUNS = 8


def forward(x: np.ndarray, w: np.ndarray, geo: ConvGeometry, y: np.ndarray,
            bias: Optional[np.ndarray] = None, tile: int = 2,
            slope: Optional[float] = None) -> np.ndarray:
    """``y = conv(x, w) + bias`` (float32, unit stride, kernel width 3) into ``y`` by
    F(tile, 3), ``tile`` 2 or 4, then LeakyReLU(``slope``) unless ``slope`` is None."""
    loops = direct.active_loops()
    assert loops is not None and supports(geo, x.dtype) and tile in _G
    assert slope is None or y.flags.c_contiguous  # the activation runs over whole spans
    kd, kh, _ = geo.kernel
    _, ho, wo = geo.out
    tiles = -(-wo // tile)
    groups = _filter_groups(geo, ho * tiles, loops)
    packed = transformed_weights(w, loops.filter_block, tile) if len(groups) == 1 else None
    fs, ds, hs = compiled.element_strides(y)[1:4]

    def work(chunk) -> None:
        n, z0, z1, f0, f1 = chunk
        weights = packed if packed is not None else transformed_weights(
            w[f0:f1], loops.filter_block, tile)
        window, depth, hp = input_window(geo, x[n], z0, z1)
        scratch = workers.scratch(
            "winograd_components",
            ((tile + 2) * geo.channels * depth * hp * tiles + loops.run,), np.float32)
        loops.winograd_forward(compiled.address(x[n]), compiled.address(window),
                               geo.channels, kd, kh,
                               compiled.address(weights), f1 - f0,
                               None if bias is None else compiled.address(bias[f0:f1]),
                               compiled.address(y[n, f0, z0]), fs, ds, hs, z1 - z0, ho, wo,
                               compiled.address(scratch), tile,
                               slope is not None, 0.0 if slope is None else slope)

    if len(groups) == 1:
        chunks = [(n, z0, z1, 0, geo.filters)
                  for n, z0, z1 in plan_chunks(geo.batch, geo.out[0], direct.CHUNK_PLANES)]
    else:
        chunks = [(n, 0, geo.out[0], f0, f1) for n in range(geo.batch) for f0, f1 in groups]
    workers.map_chunks(work, chunks)
    return y


def input_window(geo: ConvGeometry, sample: np.ndarray, z0: int, z1: int
                 ) -> tuple[np.ndarray, int, int]:
    """``(window, depth, Hp)``: the zero-padded input window that output planes z0:z1 of
    ``sample`` (C, D, H, W; rows contiguous) read, described for the loops, which read it
    in place (``native/winograd_tiles.h``, ``input_components``): its strides, origin and
    the input's extents as int64 ``[c, d, h, d0, h0, w0, D, H, W]``, and its depth and
    height.  In place rather than through a padded copy of the window, which took 10-20%
    of the paper network's conv2 passes."""
    (dl, _), (hl, _), (wl, _) = geo.padding
    _, depth, hp, _ = geo.slab_shape(z1 - z0)
    assert sample.strides[-1] == sample.itemsize
    strides = compiled.element_strides(sample)[:3]
    window = np.array([*strides, z0 - dl, -hl, -wl, *sample.shape[1:]], np.int64)
    return window, depth, hp


def _filter_groups(geo: ConvGeometry, plane_tiles: int, loops) -> list:
    """``[(f0, f1), ...]``: one group of all filters, or whole filter blocks shared among
    the workers when a sample's tiles are at most ``FILTER_SPLIT_RUNS`` register runs."""
    available = workers.num_workers()
    blocks = -(-geo.filters // loops.filter_block)
    if (available < 2 or blocks < 2
            or geo.out[0] * plane_tiles > FILTER_SPLIT_RUNS * loops.run):
        return [(0, geo.filters)]
    count = min(available, blocks)
    edges = [loops.filter_block * (blocks * k // count) for k in range(count + 1)]
    return [(e0, min(e1, geo.filters)) for e0, e1 in zip(edges, edges[1:])]


def _grad_chunk_planes(geo: ConvGeometry, tiles: int) -> int:
    """Output planes per chunk of the filter gradient: about ``GRAD_CHUNK_TILES`` tiles,
    at least ``direct.CHUNK_PLANES``, and no fewer chunks than workers."""
    wanted = max(direct.CHUNK_PLANES, -(-GRAD_CHUNK_TILES // (geo.out[1] * tiles)))
    spread = -(-geo.batch * geo.out[0] // workers.num_workers())
    return max(1, min(wanted, spread, geo.out[0]))


def filter_grad(x: np.ndarray, dy: np.ndarray, geo: ConvGeometry, tile: int = 2
                ) -> np.ndarray:
    """``dL/dw`` ``(F, C, kD, kH, 3)`` float32 (unit stride, kernel width 3) by F(tile, 3),
    ``tile`` 2 or 4; chunk partials are summed in chunk order."""
    return filter_and_bias_grad(x, dy, geo, tile, bias=False)[0]


def filter_and_bias_grad(x: np.ndarray, dy: np.ndarray, geo: ConvGeometry, tile: int = 2,
                         bias: bool = True) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(dL/dw, dL/db)``: :func:`filter_grad` and, when ``bias``, the per-filter sums of
    ``dy`` (None otherwise), summed from the loops' dy components (each tile's D_1 is
    its dy sum) while they are in cache."""
    loops = direct.active_loops()
    assert loops is not None and supports(geo, x.dtype) and tile in _G
    kd, kh, _ = geo.kernel
    _, ho, wo = geo.out
    tiles = -(-wo // tile)
    parts = tile + 2
    dplane = -(-ho * tiles // loops.lanes) * loops.lanes

    def work(chunk) -> np.ndarray:
        n, z0, z1 = chunk
        window, depth, hp = input_window(geo, x[n], z0, z1)
        grad = dy[n, :, z0:z1]
        size = (parts * geo.channels * depth * hp * tiles + loops.run
                + parts * geo.filters * (z1 - z0) * dplane
                + parts * geo.filters * geo.channels * kd * kh)
        scratch = workers.scratch("winograd_grad", (size,), np.float32)
        part = np.zeros(weights + (geo.filters if bias else 0), np.float32)
        fs, ds, hs = compiled.element_strides(grad)[:3]
        compiled.check(loops.winograd_filter_grad(
            compiled.address(x[n]), compiled.address(window), geo.channels, kd, kh,
            compiled.address(grad), fs, ds, hs, geo.filters, compiled.address(part),
            z1 - z0, ho, wo, compiled.address(scratch), tile,
            compiled.address(part[weights:]) if bias else None), "Winograd filter gradient")
        return part

    weights = int(np.prod(geo.w_shape))
    chunks = plan_chunks(geo.batch, geo.out[0], _grad_chunk_planes(geo, tiles))
    total = workers.sum_in_order(workers.map_chunks(work, chunks))
    return total[:weights].reshape(geo.w_shape), total[weights:] if bias else None
