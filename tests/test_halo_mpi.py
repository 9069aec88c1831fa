"""Halo exchange under MPI (one 8-rank launch, several grids, uneven blocks).

For each grid: the forward (replace) exchange fills every margin with the global array's
planes (edges and corners included), and so does its form without a buffer
(``gather_margins``, sending from the owned block); the backward (add) exchange is its exact adjoint
(<H x, y> = <x, H^T y>); and a convolution of each rank's exchanged block equals that
rank's block of the serial convolution.  The verdict is allreduced, so a failure on one
rank fails every rank instead of hanging them.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort_on_error

from cosmotrain.config.layout import Layout as ParallelLayout
from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.kernels.conv3d import conv3d_forward
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.halo import HaloExchange
from cosmotrain.tensor.windows import halo_plans, spatial_halos

# (layout, global shape N, C, D, H, W, kernel, stride, padding per dim)
CASES = [
    (ParallelLayout(1, depth=2, height=2, width=2), (1, 2, 7, 6, 5), (3, 3, 3), (1, 1, 1),
     ((1, 1),) * 3),
    (ParallelLayout(2, depth=2, height=2), (2, 3, 9, 8, 4), (3, 3, 3), (2, 2, 2),
     ((1, 1),) * 3),
    (ParallelLayout(1, depth=4, height=2), (1, 1, 10, 7, 3), (3, 2, 3), (1, 2, 1),
     ((1, 1), (0, 1), (2, 0))),
    (ParallelLayout(1, width=8), (1, 2, 3, 3, 19), (3, 3, 5), (1, 1, 1), ((1, 1),) * 2
     + ((2, 2),)),
    (ParallelLayout(2, depth=2, height=2), (2, 2, 6, 6, 6), (4, 4, 4), (1, 1, 1),
     ((2, 1),) * 3),
]


def rank_setup(grid: ProcessGrid, shape, kernel, stride, padding):
    layout = grid.layout
    dist = Distribution(shape, (layout.sample, 1, *layout.spatial))
    halos = spatial_halos(dist, kernel, stride, padding)
    coords = grid.spatial_coords
    plans = tuple(halo_plans(h)[c] for h, c in zip(halos, coords))
    mine = [h[c] for h, c in zip(halos, coords)]
    block = dist.block((grid.coord("sample"), 0, *coords))
    return dist, block, plans, mine


def check_case(comm, layout, shape, kernel, stride, padding) -> bool:
    grid = ProcessGrid(comm, layout)
    rng = np.random.default_rng(7)
    x = rng.normal(size=shape)
    dist, block, plans, mine = rank_setup(grid, shape, kernel, stride, padding)
    exchange = HaloExchange(grid, plans)
    buffer = np.full(block_shape(x[block].shape, exchange), np.nan)
    buffer[(...,) + exchange.own] = x[block]
    exchange.exchange(buffer, "replace")
    covered = tuple(slice(b.start - p.recv_lo, b.stop + p.recv_hi)
                    for b, p in zip(block[2:], plans))
    ok = np.array_equal(buffer, x[block[:2] + covered])
    gathered = exchange.gather_margins(x[block].copy())  # the same planes, no buffer
    ok &= all(np.array_equal(planes, buffer[(...,) + region]) for region, planes in gathered)

    y = rng.normal(size=buffer.shape)  # same stream on every rank: fine, any y works
    back = y.copy()
    exchange.exchange(back, "add")
    lhs = float((buffer * y).sum())
    rhs = float((x[block] * back[(...,) + exchange.own]).sum())
    lhs, rhs = comm.allreduce(lhs), comm.allreduce(rhs)
    ok &= abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs))

    w = rng.normal(size=(2, shape[1], *kernel))
    full = conv3d_forward(x, w, stride, padding)
    extended = buffer[(...,) + tuple(p.extended for p in plans)]
    pads = tuple((h.pad_lo, h.pad_hi) for h in mine)
    out = tuple(slice(*h.out_range) for h in mine)
    if all(s.stop > s.start for s in out):
        local = conv3d_forward(extended, w, stride, pads)
        ok &= np.allclose(local, full[block[:1] + (slice(None),) + out], atol=1e-10)
    grid.free()
    return bool(ok)


def block_shape(owned_shape, exchange: HaloExchange) -> tuple[int, ...]:
    return tuple(owned_shape[:2]) + exchange.buffer_shape


@pytest.mark.parallel(nprocs=8)
@abort_on_error
def test_halo_exchange_on_several_grids() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = []
    for layout, shape, kernel, stride, padding in CASES:
        results.append(check_case(world, layout, shape, kernel, stride, padding))
    # a 4-rank grid on each half of the job, concurrently (segmented)
    half = world.Split(world.rank // 4, world.rank)
    results.append(check_case(half, ParallelLayout(1, depth=2, width=2), (1, 2, 5, 4, 6),
                              (3, 3, 3), (1, 1, 1), ((1, 1),) * 3))
    half.Free()
    verdict = world.allreduce(all(results), op=MPI.LAND)
    assert verdict, f"rank {world.rank}: per-case results {results}"
