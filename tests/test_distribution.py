"""Block index math of ``Distribution`` (pure, no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.tensor.distribution import Distribution, block_owner, block_range, unsplit


@pytest.mark.parametrize("parts", range(1, 13))
def test_block_range_tiles_like_array_split(parts: int) -> None:
    for n in range(0, 41):
        ranges = [block_range(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
        sizes = [stop - start for start, stop in ranges]
        assert sizes == [len(a) for a in np.array_split(np.arange(n), parts)]
        assert sizes == [n // parts + (i < n % parts) for i in range(parts)]


def test_block_range_empty_blocks_when_more_parts_than_items() -> None:
    assert [block_range(3, 5, i) for i in range(5)] == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]


@pytest.mark.parametrize("args", [(-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_block_range_rejects_bad_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="block_range"):
        block_range(*args)


def test_block_owner_matches_ranges() -> None:
    for n in range(1, 30):
        for parts in range(1, 12):
            for i in range(parts):
                start, stop = block_range(n, parts, i)
                assert all(block_owner(n, parts, j) == i for j in range(start, stop))
    with pytest.raises(ValueError, match="outside"):
        block_owner(5, 2, 5)


SHAPES_GRIDS = [
    ((3, 2, 5, 7, 4), (1, 1, 2, 3, 2)),
    ((3, 2, 5, 7, 4), (2, 1, 1, 1, 4)),
    ((4, 3, 2, 8, 1), (3, 2, 4, 3, 1)),  # D split 4 ways over 2 planes: empty blocks
    ((2, 3, 5, 1, 3), (2, 3, 5, 1, 3)),  # every element its own block
    ((6,), (4,)),
]


@pytest.mark.parametrize("shape,grid", SHAPES_GRIDS)
def test_blocks_tile_the_global_array(shape: tuple[int, ...], grid: tuple[int, ...]) -> None:
    dist = Distribution(shape, grid)
    data = np.arange(int(np.prod(shape))).reshape(shape)
    assembled = np.full(shape, -1)
    hits = np.zeros(shape, dtype=int)
    for coord in dist.coords():
        block = dist.block(coord)
        local = data[block]
        assert local.shape == dist.local_shape(coord)
        assert dist.is_empty(coord) == (local.size == 0)
        if local.size:
            assert tuple(int(i) for i in np.unravel_index(local.flat[0], shape)) \
                == dist.offset(coord)
        assembled[block] = local
        hits[block] += 1
    np.testing.assert_array_equal(assembled, data)
    np.testing.assert_array_equal(hits, 1)


@pytest.mark.parametrize("shape,grid", SHAPES_GRIDS)
def test_coords_row_major_and_owner(shape: tuple[int, ...], grid: tuple[int, ...]) -> None:
    dist = Distribution(shape, grid)
    assert dist.coords() == list(np.ndindex(*grid))
    assert dist.size == len(dist.coords()) == int(np.prod(grid))
    for dim in range(len(shape)):
        for index in range(shape[dim]):
            start, stop = dist.ranges(dim)[dist.owner(dim, index)]
            assert start <= index < stop


def test_with_shape_keeps_grid() -> None:
    dist = Distribution((2, 4, 9, 9, 9), (1, 2, 3, 1, 1))
    out = dist.with_shape((2, 8, 5, 5, 5))
    assert out.grid == dist.grid and out.global_shape == (2, 8, 5, 5, 5)
    assert out.ranges(2) == [(0, 2), (2, 4), (4, 5)]


def test_distribution_is_a_hashable_value() -> None:
    assert Distribution([2, 3], [1, 3]) == Distribution((2, 3), (1, 3))
    assert len({Distribution((2, 3), (1, 3)), Distribution((2, 3), (1, 3))}) == 1


@pytest.mark.parametrize("shape,grid,match", [
    ((2, 3), (1,), "one grid entry per dimension"),
    ((2, 0), (1, 1), "sizes >= 1"),
    ((2, 3), (1, 0), "ways >= 1"),
])
def test_distribution_validation(shape: tuple[int, ...], grid: tuple[int, ...],
                                 match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Distribution(shape, grid)


def test_block_rejects_coordinate_outside_grid() -> None:
    dist = Distribution((4, 4), (2, 2))
    with pytest.raises(ValueError, match="outside grid"):
        dist.block((2, 0))
    with pytest.raises(ValueError, match="outside grid"):
        dist.block((0,))


def test_unsplit_gathers_one_dimension_and_keeps_the_others() -> None:
    """After an all-gather along C every rank holds all channels: one block there, at
    coordinate 0, which must be the whole dimension; the other dimensions stay cut."""
    dist = Distribution((4, 6, 8, 8, 8), (2, 3, 2, 1, 1))
    for coord in dist.coords():
        whole, at = unsplit(dist, coord, 1, 6)
        assert whole.grid == (2, 1, 2, 1, 1) and whole.global_shape == dist.global_shape
        assert at == (coord[0], 0, coord[2], 0, 0)
        block = whole.block(at)
        assert block[1] == slice(0, 6)
        assert block[0] == dist.block(coord)[0] and block[2] == dist.block(coord)[2]
