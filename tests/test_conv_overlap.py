"""The interior / shell split of the distributed convolution, and its memory-lean backward.

Pure geometry (no MPI): the onion slabs tile ``outer - inner`` exactly once; the interior
reads no margin plane; the sub-convolutions of a plan, assembled, equal one convolution
of the extended block (stride 2, kernels 1-4, asymmetric and oversized padding, empty
interiors).  Then, on 4 ranks, the layer against the serial one on grids where some rank
owns an *empty* block or a block thinner than its halo, with every forward path taken.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from conftest import abort_on_error
from conv_reference import serial_conv_run, spatial_twin

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import Layout as ParallelLayout
from cosmotrain.kernels.conv3d import conv3d_forward
from cosmotrain.kernels.geometry import normalize_padding, normalize_triple, output_size
from cosmotrain.layers.conv import SpatialConv3d
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Context, Parameter
from cosmotrain.tensor.boxes import Box, box_shape, box_slices, intersect, onion
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.interior import (REDO_SHELL_MAX, ConvDim, OverlapPlan, conv_dim,
                                        input_window, interior_range, overlap_plan,
                                        run_sub_conv)
from cosmotrain.tensor.windows import halo_plans, window_halos


def coverage(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    """How many of ``boxes`` cover each element of an array of ``shape``."""
    count = np.zeros(shape, dtype=int)
    for box in boxes:
        count[box_slices(box)] += 1
    return count


def random_dim(rng: np.random.Generator, max_pad_extra: int = 0) -> ConvDim:
    """A random, valid 1D local convolution (padding may exceed the kernel by the extra)."""
    while True:
        k, s, n = int(rng.integers(1, 5)), int(rng.integers(1, 3)), int(rng.integers(1, 9))
        lo, hi = (int(v) for v in rng.integers(0, k + max_pad_extra, size=2))
        out = output_size(n, k, s, lo, hi)
        if out >= 1:
            a, b = sorted(int(v) for v in rng.integers(0, n + 1, size=2))
            return ConvDim(out, n, (0, n) if rng.random() < 0.3 else (a, b), k, s, lo)


def pads_hi(dim: ConvDim) -> int:
    """The high padding that gives ``dim.out_len`` outputs (the last window's overhang)."""
    return max(0, (dim.out_len - 1) * dim.stride - dim.pad_lo + dim.kernel - dim.ext_len)


def test_onion_tiles_outer_minus_inner_once() -> None:
    outer: Box = ((1, 6), (0, 4), (2, 7))
    for inner in itertools.product(((1, 6), (2, 4), (3, 3), (1, 2), (5, 6)), repeat=3):
        inner = tuple((max(lo, o[0]), min(hi, o[1])) for (lo, hi), o in zip(inner, outer))
        slabs = onion(outer, inner)
        assert len(slabs) <= 6 and all(min(b - a for a, b in s) > 0 for s in slabs)
        expected = np.zeros((6, 4, 7), dtype=int)
        expected[box_slices(outer)] = 1
        if all(b > a for a, b in inner):
            expected[box_slices(inner)] = 0
        assert np.array_equal(coverage((6, 4, 7), slabs), expected), inner


def test_input_window_clips_to_the_block_and_pads_the_rest() -> None:
    dim = ConvDim(out_len=5, ext_len=6, owned=(1, 5), kernel=3, stride=2, pad_lo=2)
    assert input_window((0, 5), dim) == ((0, 6), (2, 3))  # planes -2 .. 8
    assert input_window((1, 3), dim) == ((0, 5), (0, 0))  # planes 0 .. 5
    assert input_window((4, 5), dim) == ((6, 6), (0, 3))  # only padding: 6 .. 9
    for _ in range(500):
        d = random_dim(np.random.default_rng(_), max_pad_extra=2)
        (lo, hi), (pl, ph) = input_window((0, d.out_len), d)
        assert output_size(hi - lo, d.kernel, d.stride, pl, ph) == d.out_len


def test_interior_reads_only_owned_planes_and_padding() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        d = random_dim(rng, max_pad_extra=2)
        first, last = interior_range(d)
        for o in range(d.out_len):
            a = o * d.stride - d.pad_lo
            real = range(max(a, 0), min(a + d.kernel, d.ext_len))
            margin = any(not d.owned[0] <= i < d.owned[1] for i in real)
            if first <= o < last:
                assert not margin, (d, o)
            elif d.owned[0] <= a and a + d.kernel <= d.owned[1]:
                assert False, f"{d}: output {o} belongs in the interior {first, last}"


def assemble(ext: np.ndarray, w: np.ndarray, stride: tuple[int, ...], plan: OverlapPlan,
             out_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The plan's calls assembled into one output, and how often each element was written."""
    y = np.full(out_shape, np.nan)
    subs = ([plan.interior] if plan.interior else []) + list(plan.shell)
    for sub in subs:
        run_sub_conv(lambda x, pad: conv3d_forward(x, w, stride, pad), ext, sub, y)
    return y, coverage(out_shape[2:], [s.out for s in subs])


@pytest.mark.parametrize("seed", range(6))
def test_assembled_sub_convolutions_equal_one_convolution(seed: int) -> None:
    rng = np.random.default_rng(seed)
    paths = set()
    for case in range(60):
        dims = tuple(random_dim(rng, max_pad_extra=1 if seed % 2 else 0) for _ in range(3))
        if case % 10 == 0:  # nothing received: no shell
            dims = tuple(replace(d, owned=(0, d.ext_len)) for d in dims)
        stride = tuple(d.stride for d in dims)
        ext = rng.normal(size=(2, 3) + tuple(d.ext_len for d in dims))
        w = rng.normal(size=(2, 3) + tuple(d.kernel for d in dims))
        pads = tuple((d.pad_lo, pads_hi(d)) for d in dims)
        expected = conv3d_forward(ext, w, stride, pads)
        assert expected.shape[2:] == tuple(d.out_len for d in dims)
        plan = overlap_plan(dims)
        paths.add((plan.interior is None, not plan.shell))
        y, count = assemble(ext, w, stride, plan, expected.shape)
        assert (count == 1).all() and len(plan.shell) <= 6
        np.testing.assert_allclose(y, expected, atol=1e-12)
    assert {(False, False), (True, False), (False, True)} <= paths


def test_padding_only_windows_take_the_bias_and_activation() -> None:
    """A sub-convolution whose windows read only padding is not convolved; the layer's
    callback writes what the kernel would (bias, then the fused LeakyReLU): the assembled
    output equals one convolution with bias and activation."""
    rng = np.random.default_rng(3)
    slope, seen = 0.1, 0
    for _ in range(200):
        dims = tuple(random_dim(rng, max_pad_extra=2) for _ in range(3))
        plan = overlap_plan(dims)
        subs = ([plan.interior] if plan.interior else []) + list(plan.shell)
        if all(sub.reads_input for sub in subs):
            continue
        seen += 1
        stride = tuple(d.stride for d in dims)
        ext = rng.normal(size=(1, 2) + tuple(d.ext_len for d in dims))
        w = rng.normal(size=(3, 2) + tuple(d.kernel for d in dims))
        bias = np.array([-1.0, 0.5, 2.0])
        pads = tuple((d.pad_lo, pads_hi(d)) for d in dims)
        expected = conv3d_forward(ext, w, stride, pads, bias=bias, activation=slope)
        y = np.full(expected.shape, np.nan)
        layer = SpatialConv3d(name="c", in_channels=2, out_channels=3, bias=True)
        layer.params["bias"] = Parameter(bias)
        layer._activation = slope
        for sub in subs:
            run_sub_conv(lambda x, pad: conv3d_forward(x, w, stride, pad, bias=bias,
                                                       activation=slope),
                         ext, sub, y, layer._padding_only)
        np.testing.assert_allclose(y, expected, atol=1e-12)
    assert seen >= 5


def test_plans_of_real_window_geometries() -> None:
    """Every rank of real splits: the interior avoids the margins, the calls tile the output."""
    cases = 0
    for size, parts, k, s, lo, hi in itertools.product(range(1, 12), (1, 2, 3, 4), (1, 2, 3, 4),
                                                      (1, 2), range(3), range(3)):
        try:
            halos = window_halos(size, parts, k, s, (lo, hi))
            plans = halo_plans(halos)
        except ValueError:
            continue
        for h, p in zip(halos, plans):
            d = conv_dim(h, p, k, s)
            if d.out_len == 0:
                continue
            cases += 1
            plan = overlap_plan((d, d, d))
            assert (plan.interior is None) == (interior_range(d) == (0, 0))
            if h.recv_lo == h.recv_hi == 0:  # nothing received: one call, no shell
                assert not plan.shell
            boxes = ([plan.interior.out] if plan.interior else []) + [b.out for b in plan.shell]
            assert (coverage((d.out_len,) * 3, boxes) == 1).all()
    assert cases > 1000


# ---- on 4 ranks ----------------------------------------------------------------------

# layout (sample, depth, height, width), cin, cout, kernel, stride, padding, bias, spatial
CASES = [
    ((1, 2, 2, 1), 3, 4, 3, 1, 1, True, (12, 10, 7)),  # separate interior call
    ((2, 2, 1, 1), 2, 3, 3, 1, 1, False, (20, 6, 5)),  # thin shell: recomputed
    ((1, 2, 1, 2), 2, 3, (4, 3, 2), (2, 1, 2), ((2, 1), (1, 1), (0, 1)), False, (11, 9, 10)),
    ((1, 1, 1, 4), 2, 3, 3, 1, 1, True, (5, 4, 3)),  # W = 3 on 4 ranks: rank 3 owns nothing
    ((1, 2, 2, 1), 2, 2, 3, 1, 1, False, (1, 8, 5)),  # D = 1 on 2 ranks: one side empty
    ((1, 1, 1, 4), 2, 2, 3, 1, ((1, 1), (1, 1), (2, 1)), False, (4, 5, 5)),  # W blocks 2,1,1,1
    ((1, 2, 2, 1), 2, 3, 4, (1, 2, 1), 1, True, (3, 6, 4)),  # D blocks 2,1 with halo 2
    ((2, 1, 2, 1), 2, 2, 5, 2, 2, False, (6, 9, 6)),  # sample x height
]


def conv_layer(cin: int, cout: int, kernel, stride, padding, bias: bool) -> Conv3d:
    """A serial :class:`Conv3d` with any per-dimension kernel, stride and padding."""
    k = normalize_triple(kernel, "kernel")
    params = {"weight": Parameter(np.zeros((cout, cin, *k)))}
    if bias:
        params["bias"] = Parameter(np.zeros(cout))
    return Conv3d(name="c", params=params, in_channels=cin, out_channels=cout, kernel=k,
                  stride=normalize_triple(stride, "stride"), padding=normalize_padding(padding),
                  bias=bias)


def saved_only_margins(layer: SpatialConv3d, x: DistTensor) -> bool:
    """Forward kept ``x`` itself and exactly the extended block's non-owned planes."""
    geo = layer.geometry(x)
    kept, margins = layer._saved
    lead = int(np.prod(x.data.shape[:2]))
    ext = geo.extended_box
    want = np.prod(box_shape(ext)) - np.prod(box_shape(intersect(ext, geo.own_box)))
    return kept is x and sum(a.size for _, a in margins) == lead * want


def one_case(world, spec) -> tuple[bool, set]:
    """Forward, input and weight gradients against the serial layer; the paths taken."""
    (sample, *spatial_ways), cin, cout, k, s, p, bias, spatial = spec
    layout = ParallelLayout(sample, depth=spatial_ways[0], height=spatial_ways[1],
                            width=spatial_ways[2])
    grid = ProcessGrid(world, layout)

    def make():
        return conv_layer(cin, cout, k, s, p, bias)

    serial, x, y, dy, dx = serial_conv_run(make, cin, spatial, seed=11)
    layer = spatial_twin(serial, make, grid)
    dist = Distribution(x.shape, (layout.sample, 1, *layout.spatial))
    coord = (grid.coord("sample"), 0, *grid.spatial_coords)
    xb = DistTensor.scatter(x, dist, coord)
    y_block = layer.forward(xb, Context())
    geo = layer.geometry(xb)
    plan = layer.plan(xb, geo)
    ok = saved_only_margins(layer, xb)
    ok &= np.allclose(y_block.data, y[y_block.dist.block(coord)], atol=1e-12)
    dx_block = layer.backward(DistTensor.scatter(dy, y_block.dist, coord), Context())
    ok &= np.allclose(dx_block.data, dx[dist.block(coord)], atol=1e-12)
    for key, param in layer.params.items():
        ok &= np.allclose(world.allreduce(param.grad), serial.params[key].grad, atol=1e-10)
    path = ("empty" if xb.data.size == 0 else "no output" if not geo.has_output
            else "one call" if not plan.shell else "wait, one call" if plan.interior is None
            else "recompute shell" if plan.shell_fraction <= REDO_SHELL_MAX else "split")
    grid.free()
    return bool(ok), {path}


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_overlapped_conv_matches_serial_with_empty_and_thin_blocks() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failed, paths = [], set()
    for i, spec in enumerate(CASES):
        ok, taken = one_case(world, spec)
        paths |= taken
        if not ok:
            failed.append(i)
    paths = set().union(*world.allgather(paths))
    assert world.allreduce(not failed, op=MPI.LAND), f"rank {world.rank} failed: {failed}"
    assert {"empty", "one call", "wait, one call", "split", "recompute shell"} <= paths, paths
