"""DistTensor scatter/gather round trip under MPI, with uneven blocks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort_on_error

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import Layout as ParallelLayout
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_scatter_gather_round_trip() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ok = True
    for layout in (ParallelLayout(2, depth=2), ParallelLayout(1, height=2, width=2),
                   ParallelLayout(4)):
        grid = ProcessGrid(world, layout)
        dist = Distribution((4, 3, 5, 7, 3), (layout.sample, 1, *layout.spatial))
        full = np.random.default_rng(1).normal(size=dist.global_shape).astype(np.float32)
        coord = (grid.coord("sample"), 0, *grid.spatial_coords)
        block = DistTensor.scatter(full, dist, coord)
        ok &= block.data.nbytes < full.nbytes
        gathered = block.gather(world, root=None)
        ok &= bool(np.array_equal(gathered, full))
        on_root = block.gather(world, root=0)
        ok &= (on_root is None) if world.rank else bool(np.array_equal(on_root, full))
        grid.free()
    assert world.allreduce(ok, op=MPI.LAND)


def test_block_shape_is_checked() -> None:
    dist = Distribution((2, 1, 4, 4, 4), (2, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="does not match"):
        DistTensor(np.zeros((2, 1, 4, 4, 4)), dist, (0, 0, 0, 0, 0))
