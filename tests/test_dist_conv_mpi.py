"""Spatially partitioned convolution and pooling equal the single-process layers (4 ranks).

For several grids and convolution shapes (stride 2, even kernels, asymmetric padding,
uneven blocks): each rank's output block, input-gradient block, and the weight gradient
summed over the ranks equal the serial layer's; the input gradient is contiguous (moved
to the front of its halo buffer).  Pooling a large block in slabs of planes, without a
halo buffer, gives one call's results bit for bit.  Verdict allreduced over all ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort_on_error
from conv_reference import serial_conv_run, spatial_twin

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import Layout as ParallelLayout
from cosmotrain.kernels import pool3d, pool_geometry
from cosmotrain.kernels.geometry import normalize_padding
from cosmotrain.layers import pool as pool_layer
from cosmotrain.layers.pool import spatial_pool
from cosmotrain.layers.windowed import halo_buffer
from cosmotrain.nn import factory
from cosmotrain.nn.layers import Pool3d
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution

LAYOUTS = [ParallelLayout(1, depth=2, height=2), ParallelLayout(2, depth=2),
           ParallelLayout(1, width=4), ParallelLayout(1, height=2, width=2)]
CONVS = [  # cin, cout, kernel, stride, symmetric padding, bias, global spatial shape
    (3, 4, 3, 1, 1, False, (9, 7, 8)),
    (2, 3, 3, 2, 1, True, (10, 9, 12)),
    (2, 2, 4, 1, 2, False, (8, 9, 11)),
    (3, 2, 1, 2, 0, False, (7, 8, 9)),
]


def one_case(world, layout: ParallelLayout, spec) -> bool:
    cin, cout, k, s, p, bias, spatial = spec
    grid = ProcessGrid(world, layout)

    def make():
        return factory.conv("c", cin, cout, k, s, p, bias=bias)

    serial, x, y, dy, dx = serial_conv_run(make, cin, spatial, seed=3)
    dw = serial.params["weight"].grad
    dist_conv = spatial_twin(serial, make, grid)
    dist = Distribution(x.shape, (layout.sample, 1, *layout.spatial))
    coord = (grid.coord("sample"), 0, *grid.spatial_coords)
    y_block = dist_conv.forward(DistTensor.scatter(x, dist, coord), Context())
    ok = np.allclose(y_block.data, y[y_block.dist.block(coord)], atol=1e-12)
    dx_block = dist_conv.backward(DistTensor.scatter(dy, y_block.dist, coord), Context())
    ok &= np.allclose(dx_block.data, dx[dist.block(coord)], atol=1e-12)
    ok &= dx_block.data.flags.c_contiguous
    ok &= np.allclose(world.allreduce(dist_conv.params["weight"].grad), dw, atol=1e-10)
    if bias:
        ok &= np.allclose(world.allreduce(dist_conv.params["bias"].grad),
                          serial.params["bias"].grad, atol=1e-10)
    grid.free()
    return bool(ok)


POOLS = [  # mode, kernel, stride, padding, global spatial shape
    ("avg", 3, 2, 1, (9, 8, 12)),
    ("max", 3, 2, 1, (10, 7, 8)),
    ("max", 2, 2, 0, (8, 10, 9)),
    ("avg", 3, 1, 1, (7, 9, 8)),
]


def one_pool_case(world, layout: ParallelLayout, spec) -> bool:
    mode, k, s, p, spatial = spec
    grid = ProcessGrid(world, layout)
    serial = Pool3d(name="p", mode=mode, kernel=(k,) * 3, stride=(s,) * 3,
                    padding=normalize_padding(p))
    rng = np.random.default_rng(5)
    x = rng.permutation(2 * 3 * int(np.prod(spatial))).reshape((2, 3) + spatial) / 7.0
    y = serial.forward(x, Context())
    dy = rng.normal(size=y.shape)
    dx = serial.backward(dy, Context())
    dist = Distribution(x.shape, (layout.sample, 1, *layout.spatial))
    coord = (grid.coord("sample"), 0, *grid.spatial_coords)
    pool = spatial_pool(serial, grid)
    y_block = pool.forward(DistTensor.scatter(x, dist, coord), Context())
    ok = np.allclose(y_block.data, y[y_block.dist.block(coord)], atol=1e-12)
    dx_block = pool.backward(DistTensor.scatter(dy, y_block.dist, coord), Context())
    ok &= np.allclose(dx_block.data, dx[dist.block(coord)], atol=1e-12)
    ok &= dx_block.data.flags.c_contiguous
    grid.free()
    return bool(ok)


def one_slab_case(world, layout: ParallelLayout, spec) -> bool:
    """The layer's forward against one kernel call on the filled halo buffer (the way the
    layer pooled before it pooled in slabs), bit for bit, argmax included."""
    mode, k, s, p, spatial = spec
    grid = ProcessGrid(world, layout)
    x = np.random.default_rng(6).normal(size=(2, 3) + spatial)
    dist = Distribution(x.shape, (layout.sample, 1, *layout.spatial))
    coord = (grid.coord("sample"), 0, *grid.spatial_coords)
    block = DistTensor.scatter(x, dist, coord)
    pool = spatial_pool(Pool3d(name="p", mode=mode, kernel=(k,) * 3, stride=(s,) * 3,
                               padding=normalize_padding(p)), grid)
    y = pool.forward(block, Context())
    geo = pool.geometry(block)
    buffer = halo_buffer(block, geo)
    geo.exchange.exchange(buffer, "replace")
    ok = True
    if geo.has_output:
        args = (buffer[geo.extended], pool.kernel, pool.stride, geo.padding)
        if mode == "avg":
            ok = np.array_equal(y.data, pool3d.avg_pool3d_forward(*args))
        else:
            y0, argmax0 = pool3d.max_pool3d_forward(*args)
            ok = np.array_equal(y.data, y0) and np.array_equal(pool._argmax, argmax0)
    grid.free()
    return bool(ok)


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_spatial_conv_and_pool_match_serial() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    results = {(layout.describe(), i): one_case(world, layout, spec)
               for layout in LAYOUTS for i, spec in enumerate(CONVS)}
    results.update({(layout.describe(), "pool", i): one_pool_case(world, layout, spec)
                    for layout in LAYOUTS for i, spec in enumerate(POOLS)})
    failed = [key for key, ok in results.items() if not ok]
    assert world.allreduce(not failed, op=MPI.LAND), f"rank {world.rank} failed: {failed}"


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_spatial_pool_in_slabs_is_one_call_bit_for_bit(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Every block counts as large here (the kernels pool it plane by plane) and slabs are
    as thin as they go, so the layer receives its margins without a halo buffer and pools
    one output plane's window at a time."""
    from mpi4py import MPI

    monkeypatch.setattr(pool_geometry, "WHOLE_BYTES", 0)
    monkeypatch.setattr(pool_layer, "SLAB_BYTES", 1)
    world = MPI.COMM_WORLD
    results = {(layout.describe(), i): one_slab_case(world, layout, spec)
               for layout in LAYOUTS for i, spec in enumerate(POOLS)}
    failed = [key for key, ok in results.items() if not ok]
    assert world.allreduce(not failed, op=MPI.LAND), f"rank {world.rank} failed: {failed}"
