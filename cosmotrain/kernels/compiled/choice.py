"""Which compiled kernel, if any, runs a convolution: the rules and their measurements.

The compiled loops (:mod:`.direct`, :mod:`.winograd`) beat the GEMM lowerings of
:mod:`.conv3d` on some shapes and lose on others; these rules, from per-layer timings on
one core (``benchmarks/bench_compiled.py`` and docs/PERFORMANCE.md, "Compiled
convolution and pooling loops", 2026-11-27), pick per call: :func:`forward_kernel`,
:func:`data_grad_kernel` and :func:`filter_grad_kernel` name the algorithm ("winograd",
"direct" or "lowered", :mod:`.conv3d`'s own lowerings) that :mod:`.conv3d` runs.  Kept
apart from conv3d so that the rules and their numbers read in one place.
"""

from __future__ import annotations

import numpy as np

from cosmotrain.kernels.compiled import direct, winograd
from cosmotrain.kernels.geometry import ConvGeometry

# Compiled direct convolution loops (:mod:`.direct`) for unit-stride float32 layers whose
# output rows fill whole register runs (32 outputs with AVX-512): 1.2-2.8x the lowerings
# on the thin layers, level on 32-64 channels.  False: the lowerings only, no compiled
# convolution (the benchmarks' --no-direct, for A/B runs).
USE_DIRECT = True
# Largest share of a row that rounding the output width up to whole runs may waste.
MAX_DIRECT_WASTE = 1 / 8
# Winograd F(2,3) along W (:mod:`.winograd`) for 3-wide unit-stride float32 layers with
# at least this many input and output channels.  It was 32 while the forward read every
# component's weights once per register run (cosmoflow conv2, 16 -> 32: 65 ms against the
# direct loops' 56); with the chunked forward (native/winograd_body.h) that layer takes
# 46 ms against 53, and its data gradient (32 -> 16) 59 against 60.  4 channels
# (conv1): 95-182 ms against the direct loops' 58-126, hence not below 16 ...
WINOGRAD_MIN_CHANNELS = 16
# ... and at least this many register runs of outputs per plane.  It was 4 while each run
# read all the transformed weights and numpy transformed them (MLPerf conv5, 8^3, one run
# a plane: 44 ms against 26 lowered on one core).  Now runs are chunked across planes,
# the transform is compiled and a small sample is shared among workers by filters
# (winograd.FILTER_SPLIT_RUNS): conv5 forward 22 / 13 ms on 1 / 2 cores against 26 / 15
# lowered, data gradient 35 / 18 against 35 / 22 (2026-11-27).
WINOGRAD_MIN_RUNS = 1
# F(4,3) (2x fewer products, 6 components) rather than F(2,3) for output rows of at least
# this many (one core, forward / data gradient: MLPerf conv3 88 -> 74 / 92 -> 78 ms,
# conv4 42 -> 33 / 50 -> 52, conv2 202 -> 198 / 214 -> 194; 8^3 planes: slower).
WINOGRAD4_MIN_WIDTH = 16
# Its filter gradient sums each component over chunks of planes: worth it from this many
# tiles a plane (one core: MLPerf conv3, 32^3, 97 -> 74 ms; conv4, 16^3 = 128 tiles, 45
# lowered -> 34; conv5, 8^3 = 32 tiles: 22 lowered, 30 by Winograd, whose per-sum costs
# then outweigh the products saved).
WINOGRAD_GRAD_MIN_TILES = 128
# ... and input channels (4: its dy transform costs more than the products saved,
# cosmoflow conv1 95 ms against the direct loops' 68; 16: cosmoflow conv2 54 against 60).
WINOGRAD_GRAD_MIN_CHANNELS = 16


def direct_loops(geo: ConvGeometry, dtype) -> bool:
    """Whether the compiled direct loops run this convolution (forward / filter gradient;
    the data gradient asks about its transposed convolution)."""
    if not (USE_DIRECT and direct.supports(geo, dtype)):
        return False
    wo, run = geo.out[2], direct.register_run()
    return wo >= run and (-(-wo // run) * run - wo) <= wo * MAX_DIRECT_WASTE


def winograd_forward(geo: ConvGeometry, dtype) -> bool:
    """Whether Winograd F(2,3) along W runs this convolution (forward; the data gradient
    asks about its transposed convolution)."""
    if not (USE_DIRECT and winograd.supports(geo, dtype)):
        return False
    tiles = geo.out[1] * -(-geo.out[2] // 2)
    return (min(geo.channels, geo.filters) >= WINOGRAD_MIN_CHANNELS
            and tiles >= WINOGRAD_MIN_RUNS * direct.register_run())


def winograd_filter_grad(geo: ConvGeometry, dtype) -> bool:
    """Whether the filter gradient takes Winograd F(2,3) along W."""
    return (USE_DIRECT and winograd.supports(geo, dtype)
            and geo.channels >= WINOGRAD_GRAD_MIN_CHANNELS
            and geo.out[1] * -(-geo.out[2] // 2) >= WINOGRAD_GRAD_MIN_TILES)


def winograd_tile(geo: ConvGeometry) -> int:
    """Outputs per Winograd tile along W for a convolution that takes Winograd: 4 or 2.
    The filter gradient's F(4,3) follows the same rule (one core: cosmoflow conv2 53 ->
    45 ms, MLPerf conv2 165 -> 135, conv3 76 -> 65, conv4 37 -> 31; 8^3 planes 28 -> 41)."""
    return 4 if geo.out[2] >= WINOGRAD4_MIN_WIDTH else 2


def forward_kernel(geo: ConvGeometry, dtype) -> str:
    """The forward's algorithm: Winograd, else the direct loops, else the lowerings."""
    if winograd_forward(geo, dtype):
        return "winograd"
    return "direct" if direct_loops(geo, dtype) else "lowered"


def data_grad_kernel(transposed: ConvGeometry, channels: int, dtype) -> str:
    """The unit-stride data gradient's algorithm, asked of its ``transposed`` convolution
    (dy with the flipped kernel) whose outputs are the layer's ``channels``: the direct
    loops need at least a register block of them (a thinner block wastes its lanes)."""
    if winograd_forward(transposed, dtype):
        return "winograd"
    if direct_loops(transposed, dtype) and channels >= direct.filter_block():
        return "direct"
    return "lowered"


def filter_grad_kernel(geo: ConvGeometry, dtype) -> str:
    """The filter gradient's algorithm."""
    if winograd_filter_grad(geo, dtype):
        return "winograd"
    return "direct" if direct_loops(geo, dtype) else "lowered"


def packs_activation_grad(geo: ConvGeometry, x, dy, y) -> bool:
    """Whether the filter gradient runs the backward of the LeakyReLU after the layer
    (output ``y``) as it packs dy: the direct loops, on float32 numpy arrays with y laid
    out as dy and dy's rows read in place (:func:`.direct.packs_activation`)."""
    return (all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in (x, dy, y))
            and y.shape == dy.shape and y.strides == dy.strides
            and filter_grad_kernel(geo, np.float32) == "direct"
            and direct.packs_activation(geo))
