"""Redistribution (all-to-all) and local batch-norm statistics on 4 ranks.

* Between pairs of distributions (uneven, empty blocks, different split dimensions):
  each rank's target block equals the slice of the global array, and the reverse plan
  (the adjoint, a permutation's inverse) gives back the source block exactly; source
  blocks that do not cover a target block exactly once are refused.
* ``parallel.bn_statistics: local`` on N2D2: each sample group normalises with its own
  share of the batch, so its predictions equal one process run on that share alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort_on_error

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.load import load_config
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.tensor.boxes import box_empty, intersect, to_local
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.redistribute import Redistribution

SHAPE = (3, 2, 7, 5, 6)
PAIRS = [  # (source grid, target grid), 4 blocks each
    ((1, 1, 2, 2, 1), (4, 1, 1, 1, 1)),  # spatial blocks -> samples (one rank empty)
    ((1, 1, 4, 1, 1), (1, 1, 1, 1, 4)),  # depth slabs -> width slabs
    ((2, 1, 1, 2, 1), (1, 2, 2, 1, 1)),
    ((1, 1, 1, 1, 4), (1, 1, 1, 1, 4)),  # identity
]


def test_intersect_and_local_boxes() -> None:
    a = ((0, 4), (2, 6))
    b = ((3, 9), (0, 3))
    assert intersect(a, b) == ((3, 4), (2, 3))
    assert box_empty(intersect(a, ((4, 5), (0, 9))))
    assert to_local(((3, 4), (2, 3)), b) == ((0, 1), (2, 3))


def redistribution_ok(world, src_grid, dst_grid) -> bool:
    full = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    src, dst = Distribution(SHAPE, src_grid), Distribution(SHAPE, dst_grid)
    src_coord, dst_coord = src.coords()[world.rank], dst.coords()[world.rank]
    plan = Redistribution.plan(world, src, src_coord, dst, dst_coord)
    moved = plan(full[src.block(src_coord)].copy())
    back = plan.reverse()(moved)
    return (np.array_equal(moved, full[dst.block(dst_coord)])
            and np.array_equal(back, full[src.block(src_coord)]))


def partial_cover_refused(world) -> bool:
    """Source coordinates that leave part of a target block uncovered (the 4 ranks all
    claim the same one-row source block: 4 rows of 5, some twice) are refused."""
    src, dst = Distribution((5, 3), (4, 1)), Distribution((5, 3), (1, 1))
    try:
        Redistribution.plan(world, src, (3, 0), dst, (0, 0))
    except ValueError as err:
        return "exactly once" in str(err)
    return False


def local_bn_ok(world) -> bool:
    overrides = ["model.name=tiny", "model.width=12", "model.batchnorm=true",
                 "train.batch_size=4", "parallel.sample=2", "parallel.depth=2",
                 "parallel.bn_statistics=local"]
    cfg = load_config(None, overrides)
    grid = ProcessGrid(world, resolve_parallel(cfg, world.Get_size()))
    from cosmotrain.engine.step import hybrid_step_from_config

    step = hybrid_step_from_config(cfg, grid)
    x = np.random.default_rng(2).normal(size=(4, 4, 12, 12, 12)).astype(np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    pred = step.model.forward(DistTensor.scatter(x, dist, coord), Context())
    start, stop = step.model.sample_range()
    group = slice(2 * grid.coord("sample"), 2 * grid.coord("sample") + 2)
    serial = build_model(cfg.model, cfg.train.seed).forward(x[group].copy(), Context())
    grid.free()
    return np.allclose(pred, serial[start - group.start:stop - group.start], rtol=1e-4,
                       atol=1e-5)


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_redistribution_and_local_batchnorm() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _parallel.set_num_workers(1)
    results = {pair: redistribution_ok(world, *pair) for pair in PAIRS}
    results["partial cover refused"] = partial_cover_refused(world)
    results["local bn"] = local_bn_ok(world)
    failed = [key for key, ok in results.items() if not ok]
    assert world.allreduce(not failed, op=MPI.LAND), f"rank {world.rank} failed: {failed}"
