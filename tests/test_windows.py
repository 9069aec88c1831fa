"""Halo geometry of sliding windows on a partitioned tensor, checked with real windows.

Each rank's extended block is built from its own block plus what the ``HaloPlan`` makes its
neighbours send; the local layer on it (with the rank's boundary padding) must give exactly
that rank's slice of the serial result.  References are direct loops, independent of the
``np.correlate`` / sliding-window local computations.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from cosmotrain.kernels.geometry import output_size
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.windows import (HaloPlan, WindowHalo, check_halos, extended_range,
                                       halo_plans, plane_runs, spatial_halos, window_halos)

SIZES = range(1, 15)
STRIDES = (1, 2, 3)
PADDINGS = ((0, 0), (1, 1), (2, 2), (0, 1), (1, 0), (0, 2), (2, 0), (3, 1), (0, 4))


# ---------------------------------------------------------------- references (direct loops)

def ref_conv1d(x: np.ndarray, w: np.ndarray, stride: int, pad: tuple[int, int]) -> np.ndarray:
    """Serial 1D cross-correlation with zero padding, one output at a time."""
    xp = np.concatenate([np.zeros(pad[0]), x, np.zeros(pad[1])])
    out = output_size(len(x), len(w), stride, *pad)
    return np.array([sum(xp[o * stride + j] * w[j] for j in range(len(w)))
                     for o in range(out)])


def ref_conv1d_backward(dy: np.ndarray, w: np.ndarray, size: int, stride: int,
                        pad: tuple[int, int]) -> np.ndarray:
    """Gradient of ``ref_conv1d`` w.r.t. its input of length ``size``."""
    dxp = np.zeros(size + pad[0] + pad[1])
    for o, j in itertools.product(range(len(dy)), range(len(w))):
        dxp[o * stride + j] += dy[o] * w[j]
    return dxp[pad[0]:pad[0] + size]


def ref_pool1d(x: np.ndarray, k: int, stride: int, pad: tuple[int, int],
               reduce: Callable[[list[float]], float], fill: float) -> np.ndarray:
    """Serial 1D pooling; padded positions hold ``fill`` (0 for average, -inf for max)."""
    xp = [fill] * pad[0] + list(x) + [fill] * pad[1]
    out = output_size(len(x), k, stride, *pad)
    return np.array([reduce(xp[o * stride:o * stride + k]) for o in range(out)])


def ref_conv3d(x: np.ndarray, w: np.ndarray, stride: tuple[int, ...],
               pad: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Serial (N, C, D, H, W) x (F, C, kD, kH, kW) cross-correlation, one voxel at a time."""
    xp = np.pad(x, ((0, 0), (0, 0), *pad))
    out = [output_size(n, k, s, *p) for n, k, s, p in zip(x.shape[2:], w.shape[2:], stride, pad)]
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for d, h, v in itertools.product(*(range(o) for o in out)):
        window = xp[:, :, d * stride[0]:d * stride[0] + w.shape[2],
                    h * stride[1]:h * stride[1] + w.shape[3],
                    v * stride[2]:v * stride[2] + w.shape[4]]
        y[:, :, d, h, v] = np.einsum("ncijk,fcijk->nf", window, w)
    return y


# ------------------------------------------------------- local computations (other code path)

def local_conv1d(ext: np.ndarray, w: np.ndarray, stride: int, h: WindowHalo) -> np.ndarray:
    """What a rank computes: np.correlate on its padded extended block (none if no output)."""
    if h.out_range[0] == h.out_range[1]:
        return np.zeros(0)
    xp = np.concatenate([np.zeros(h.pad_lo), ext, np.zeros(h.pad_hi)])
    return np.correlate(xp, w, mode="valid")[::stride]


def local_pool1d(ext: np.ndarray, k: int, stride: int, h: WindowHalo, how: str) -> np.ndarray:
    """Average (zeros in the padding, divide by k) or max (-inf in the padding) pooling."""
    if h.out_range[0] == h.out_range[1]:
        return np.zeros(0)
    fill = 0.0 if how == "avg" else -np.inf
    xp = np.concatenate([np.full(h.pad_lo, fill), ext, np.full(h.pad_hi, fill)])
    windows = sliding_window_view(xp, k)[::stride]
    return windows.mean(axis=-1) if how == "avg" else windows.max(axis=-1)


# ------------------------------------------------------------ simulated halo exchange (1 dim)

def exchange(owned: list[np.ndarray], plans: list[HaloPlan], axis: int = 0) -> list[np.ndarray]:
    """Forward (replace): each rank's buffer = received low margin | own | high margin."""
    buffers = []
    for r, (mine, plan) in enumerate(zip(owned, plans)):
        none = take(mine, slice(0, 0), axis)
        lo = take(owned[r - 1], plans[r - 1].send_hi, axis) if r > 0 else none
        hi = take(owned[r + 1], plans[r + 1].send_lo, axis) if r + 1 < len(plans) else none
        assert lo.shape[axis] == plan.recv_lo and hi.shape[axis] == plan.recv_hi
        buffers.append(np.concatenate([lo, mine, hi], axis=axis))
        assert buffers[-1].shape[axis] == plan.buffer_size
    return buffers


def exchange_add(buffers: list[np.ndarray], plans: list[HaloPlan]) -> list[np.ndarray]:
    """Backward (add): margins go back to their owners and are added to the sent planes."""
    owned = [b[p.own].copy() for b, p in zip(buffers, plans)]
    for r, (buf, plan) in enumerate(zip(buffers, plans)):
        if r > 0:
            owned[r - 1][plans[r - 1].send_hi] += buf[plan.margin_lo]
        if r + 1 < len(plans):
            owned[r + 1][plans[r + 1].send_lo] += buf[plan.margin_hi]
    return owned


def take(a: np.ndarray, index: slice, axis: int) -> np.ndarray:
    """``a[..., index, ...]`` along ``axis``."""
    return a[(slice(None),) * axis + (index,)]


def fits_neighbours(halos: list[WindowHalo]) -> bool:
    """Independent statement of ``check_halos``: every needed input plane of a rank with
    output lies in its own or a direct neighbour's block, and no such rank owns nothing."""
    bounds = [0] + [h.own_range[1] for h in halos]
    for r, h in enumerate(halos):
        if h.out_range[0] == h.out_range[1]:
            continue
        if h.owned == 0:
            return False
        reach = set(range(bounds[max(r - 1, 0)], bounds[min(r + 2, len(halos))]))
        if not set(range(*h.in_range)) <= reach:
            return False
    return True


def sweep() -> list[tuple[int, int, int, int, tuple[int, int]]]:
    """All (size, parts, kernel, stride, padding) cases whose window fits the input."""
    return [(n, parts, k, s, p)
            for n, parts, k, s, p in itertools.product(SIZES, (2, 3, 4), range(1, 6), STRIDES,
                                                         PADDINGS)
            if output_size(n, k, s, *p) >= 1]


# ------------------------------------------------------------------------------- the tests

def test_output_size() -> None:
    assert output_size(8, 3, 1, 1, 1) == 8
    assert output_size(8, 3, 2, 1, 1) == 4
    assert output_size(7, 2, 2, 0, 0) == 3
    assert output_size(5, 3, 1, 0, 2) == 5


def test_conv1d_every_rank_gets_its_output_block() -> None:
    rng = np.random.default_rng(0)
    checked = rejected = cropped = 0
    for n, parts, k, s, p in sweep():
        x, w = rng.standard_normal(n), rng.standard_normal(k)
        halos = window_halos(n, parts, k, s, p)
        if not fits_neighbours(halos):
            with pytest.raises(ValueError, match="smaller than the halo|input block is empty"):
                halo_plans(halos)
            rejected += 1
            continue
        plans = halo_plans(halos)
        y = ref_conv1d(x, w, s, p)
        assert [h.out_range for h in halos][-1][1] == len(y)
        buffers = exchange([x[slice(*h.own_range)] for h in halos], plans)
        for h, plan, buf in zip(halos, plans, buffers):
            ext = buf[plan.extended]
            np.testing.assert_array_equal(ext, x[slice(*h.in_range)])
            np.testing.assert_allclose(local_conv1d(ext, w, s, h), y[slice(*h.out_range)],
                                       atol=1e-12, err_msg=f"{n=} {parts=} {k=} {s=} {p=} {h}")
            cropped += h.halo_lo < 0 or h.halo_hi < 0
        checked += 1
    assert checked > 2000 and rejected > 50 and cropped > 500  # the sweep covers all branches


def test_conv1d_backward_adds_margin_gradients_to_owners() -> None:
    rng = np.random.default_rng(1)
    for n, parts, k, s, p in sweep()[::7]:
        halos = window_halos(n, parts, k, s, p)
        if not fits_neighbours(halos):
            continue
        plans = halo_plans(halos)
        w = rng.standard_normal(k)
        dy = rng.standard_normal(output_size(n, k, s, *p))
        dx = ref_conv1d_backward(dy, w, n, s, p)
        grads = []
        for h, plan in zip(halos, plans):
            dext = ref_conv1d_backward(dy[slice(*h.out_range)], w,
                                       h.in_range[1] - h.in_range[0], s, (h.pad_lo, h.pad_hi))
            dbuf = np.zeros(plan.buffer_size)  # cropped planes get zero gradient
            dbuf[plan.extended] = dext
            grads.append(dbuf)
        for h, got in zip(halos, exchange_add(grads, plans)):
            np.testing.assert_allclose(got, dx[slice(*h.own_range)], atol=1e-12)


def test_exchange_dot_test() -> None:
    """<A x, y> == <x, A^T y>: add mode is exactly the adjoint of replace mode."""
    rng = np.random.default_rng(2)
    for n, parts, k, s, p in sweep()[::5]:
        halos = window_halos(n, parts, k, s, p)
        if not fits_neighbours(halos):
            continue
        plans = halo_plans(halos)
        x = [rng.standard_normal(h.owned) for h in halos]
        y = [rng.standard_normal(plan.buffer_size) for plan in plans]
        lhs = sum(float(a @ b) for a, b in zip(exchange(x, plans), y))
        rhs = sum(float(a @ b) for a, b in zip(x, exchange_add(y, plans)))
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("how", ["avg", "max"])
@pytest.mark.parametrize("k,s,p", [(3, 2, (1, 1)), (2, 2, (0, 0))])
def test_pool1d_every_rank_gets_its_output_block(how: str, k: int, s: int,
                                                 p: tuple[int, int]) -> None:
    rng = np.random.default_rng(3)
    reduce = (lambda v: sum(v) / k) if how == "avg" else max
    for n, parts in itertools.product(range(2, 20), (2, 3, 4)):
        halos = window_halos(n, parts, k, s, p)
        if not fits_neighbours(halos):
            continue
        x = rng.standard_normal(n)
        y = ref_pool1d(x, k, s, p, reduce, 0.0 if how == "avg" else -np.inf)
        plans = halo_plans(halos)
        for h, plan, buf in zip(halos, plans, exchange([x[slice(*h.own_range)] for h in halos],
                                                       plans)):
            np.testing.assert_allclose(local_pool1d(buf[plan.extended], k, s, h, how),
                                       y[slice(*h.out_range)], atol=1e-12)


CASES_3D = [  # global spatial shape, spatial grid, kernel, stride, padding
    ((6, 7, 5), (2, 3, 2), (3, 3, 3), (1, 1, 1), ((1, 1), (1, 1), (1, 1))),
    ((7, 8, 6), (3, 2, 2), (3, 2, 5), (2, 2, 1), ((1, 1), (0, 0), (2, 2))),
    ((8, 5, 9), (4, 1, 3), (4, 1, 2), (2, 1, 3), ((2, 1), (0, 0), (0, 1))),
    ((5, 6, 7), (2, 2, 2), (1, 3, 3), (3, 2, 2), ((0, 0), (2, 0), (1, 1))),
]


@pytest.mark.parametrize("spatial,grid,kernel,stride,padding", CASES_3D)
def test_conv3d_every_rank_gets_its_output_block(spatial, grid, kernel, stride,
                                                 padding) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 2, *spatial))
    w = rng.standard_normal((3, 2, *kernel))
    y = ref_conv3d(x, w, stride, padding)
    dist = Distribution(x.shape, (1, 1, *grid))
    out_dist = dist.with_shape(y.shape)
    halos = spatial_halos(dist, kernel, stride, padding)
    plans = [halo_plans(hs) for hs in halos]
    for coord in dist.coords():
        hs = [halos[i][coord[2 + i]] for i in range(3)]
        assert tuple(slice(*h.out_range) for h in hs) == out_dist.block(coord)[2:]
        ext = x[(slice(None), slice(None), *(slice(*h.in_range) for h in hs))]
        assert all(slice(*extended_range(h)) == plans[i][coord[2 + i]].extended
                   for i, h in enumerate(hs))
        xp = np.pad(ext, ((0, 0), (0, 0), *((h.pad_lo, h.pad_hi) for h in hs)))
        windows = sliding_window_view(xp, kernel, axis=(2, 3, 4))[
            :, :, ::stride[0], ::stride[1], ::stride[2]]
        local = np.einsum("ncdhvijk,fcijk->nfdhv", windows, w)
        np.testing.assert_allclose(local, y[out_dist.block(coord)], atol=1e-12)


def test_exchange_along_one_axis_of_a_3d_block() -> None:
    """The plan indexes one axis; slicing a 5D block along H works the same way."""
    x = np.arange(2 * 9 * 4, dtype=float).reshape(1, 2, 1, 9, 4)
    dist = Distribution(x.shape, (1, 1, 1, 3, 1))
    halos = window_halos(9, 3, 3, 1, (1, 1))
    plans = halo_plans(halos)
    owned = [x[dist.block((0, 0, 0, r, 0))] for r in range(3)]
    for h, plan, buf in zip(halos, plans, exchange(owned, plans, axis=3)):
        np.testing.assert_array_equal(buf[:, :, :, plan.extended], x[:, :, :, slice(*h.in_range)])


def test_plan_send_matches_neighbour_receive() -> None:
    for n, parts, k, s, p in sweep():
        halos = window_halos(n, parts, k, s, p)
        if not fits_neighbours(halos):
            continue
        plans = halo_plans(halos)
        assert plans[0].recv_lo == 0 and plans[0].send_lo == slice(0, 0)
        assert plans[-1].recv_hi == 0 and plans[-1].send_hi.stop - plans[-1].send_hi.start == 0
        for r in range(parts - 1):
            lower, upper = plans[r], plans[r + 1]
            assert len(range(lower.owned)[lower.send_hi]) == upper.recv_lo
            assert len(range(upper.owned)[upper.send_lo]) == lower.recv_hi
            assert lower.send_hi.stop == lower.owned and upper.send_lo.start == 0
        for h, plan in zip(halos, plans):
            ext = plan.extended
            assert 0 <= ext.start <= ext.stop <= plan.buffer_size
            assert ext.stop - ext.start + h.pad_lo + h.pad_hi == (
                0 if h.out_range[0] == h.out_range[1]
                else (h.out_range[1] - h.out_range[0] - 1) * s + k)


def test_negative_halos_crop_the_owned_block() -> None:
    # 10 inputs, k1 s3: outputs [0, 3, 6, 9] -> rank 1 owns [5, 10) but needs [6, 10)
    halos = window_halos(10, 2, 1, 3, (0, 0))
    assert [h.out_range for h in halos] == [(0, 2), (2, 4)]
    assert halos[0].in_range == (0, 4) and halos[0].halo_hi == -1
    assert halos[1].in_range == (6, 10) and halos[1].halo_lo == -1
    plans = halo_plans(halos)
    assert plans[1].extended == slice(1, 5) and plans[0].extended == slice(0, 4)
    assert plans[0].send_hi == slice(5, 5) and plans[1].recv_lo == 0


def test_halo_geometry_of_a_same_conv() -> None:
    halos = window_halos(8, 2, 3, 1, (1, 1))
    assert [(h.halo_lo, h.halo_hi, h.pad_lo, h.pad_hi) for h in halos] == [
        (0, 1, 1, 0), (1, 0, 0, 1)]
    plans = halo_plans(halos)
    assert plans[0].send_hi == slice(3, 4) and plans[1].send_lo == slice(0, 1)
    assert plans[1].margin_lo == slice(0, 1) and plans[1].own == slice(1, 5)


def test_check_halos_rejects_halo_wider_than_neighbour_block() -> None:
    halos = window_halos(4, 4, 5, 1, (2, 2))  # blocks of 1 plane, halos of 2
    with pytest.raises(ValueError, match=r"dimension W, rank 0: the upper neighbour's block "
                                         r"\(rank 1, 1 planes\) is smaller than the halo of 2"):
        check_halos(halos, "W")


def test_check_halos_rejects_empty_input_with_output() -> None:
    halos = window_halos(2, 4, 1, 1, (1, 1))  # 2 inputs, 4 outputs over 4 ranks
    with pytest.raises(ValueError, match="dimension D, rank 2: the input block is empty"):
        check_halos(halos, "D")


def test_spatial_halos_names_the_dimension() -> None:
    dist = Distribution((1, 1, 8, 4, 8), (1, 1, 2, 4, 1))
    with pytest.raises(ValueError, match="dimension H, rank"):
        spatial_halos(dist, (3, 5, 3), (1, 1, 1), ((1, 1), (2, 2), (1, 1)))
    with pytest.raises(ValueError, match="one kernel, stride and padding entry"):
        spatial_halos(dist, (3, 3), (1, 1, 1), ((1, 1),) * 3)


def test_empty_output_block_needs_nothing() -> None:
    halos = window_halos(9, 4, 3, 3, (0, 0))  # 3 outputs over 4 ranks
    last = halos[-1]
    assert last.out_range[0] == last.out_range[1]
    assert (last.recv_lo, last.recv_hi, last.pad_lo, last.pad_hi) == (0, 0, 0, 0)
    assert extended_range(last) == (0, 0)


@pytest.mark.parametrize("args,match", [
    ((4, 2, 6, 1, (0, 0)), "smaller than the kernel"),
    ((4, 2, 0, 1, (0, 0)), "kernel=0"),
    ((4, 2, 3, 0, (1, 1)), "stride=0"),
    ((4, 2, 3, 1, (-1, 1)), "padding"),
    ((4, 0, 3, 1, (1, 1)), "parts=0"),
])
def test_window_halos_rejects_bad_windows(args, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        window_halos(*args)


@pytest.mark.parametrize("size, kernel, stride, pad", [(17, 3, 2, (1, 1)), (16, 3, 2, (0, 1)),
                                                       (9, 3, 1, (1, 1)), (10, 4, 3, (2, 0)),
                                                       (5, 2, 2, (0, 0))])
@pytest.mark.parametrize("max_planes", [1, 3, 7, 100])
def test_plane_runs_tile_the_outputs_each_with_its_window(size, kernel, stride, pad,
                                                          max_planes) -> None:
    """Runs cover the outputs in order; each reads the planes and padding that give
    exactly its outputs, at most ``max_planes`` planes unless a single output needs more."""
    out_len = output_size(size, kernel, stride, *pad)
    runs = plane_runs(out_len, size, kernel, stride, pad[0], max_planes)
    assert [o for o, _, _ in runs][0][0] == 0 and runs[-1][0][1] == out_len
    assert all(a[0][1] == b[0][0] for a, b in zip(runs, runs[1:]))
    for (o0, o1), (lo, hi), pads in runs:
        assert 0 <= lo < hi <= size
        assert output_size(hi - lo, kernel, stride, *pads) == o1 - o0
        assert hi - lo <= max_planes or o1 - o0 == 1
        assert lo == max(0, o0 * stride - pad[0])
