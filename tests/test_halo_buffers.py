"""One rank's halo buffer layout (pure, no MPI): its parts tile the buffer and sit where the
window halos say, in global planes; a gradient buffer's owned block is moved to the front
of the buffer's memory (``compact_owned``), not copied."""

from __future__ import annotations

import itertools

import numpy as np

from cosmotrain.kernels.geometry import output_size
from cosmotrain.tensor.boxes import Box, box_slices
from cosmotrain.tensor.distribution import Distribution, block_range
from cosmotrain.tensor.halo_buffers import buffer_layout

CASES = [  # (global shape, grid, kernel, stride, padding)
    ((2, 3, 8, 6, 7), (1, 1, 2, 3, 1), (3, 3, 3), (1, 1, 1), ((1, 1),) * 3),
    ((1, 2, 9, 8, 5), (1, 1, 3, 2, 2), (3, 2, 3), (2, 2, 1), ((0, 1), (0, 0), (2, 0))),
    ((1, 1, 9, 4, 4), (1, 1, 4, 1, 2), (3, 1, 2), (3, 1, 2), ((0, 0), (0, 0), (0, 0))),
]


def coverage(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    count = np.zeros(shape, dtype=int)
    for box in boxes:
        count[box_slices(box)] += 1
    return count


def test_layout_parts_tile_the_buffer_and_match_the_halos() -> None:
    for shape, grid, kernel, stride, padding in CASES:
        dist = Distribution(shape, grid)
        for coord in itertools.product(*(range(g) for g in grid)):
            lay = buffer_layout(dist, coord, kernel, stride, padding)
            buf = lay.buffer_shape
            assert (coverage(buf, lay.margins() + [lay.own_box]) == 1).all(), coord
            ext = coverage(buf, [lay.extended_box])
            assert np.array_equal(coverage(buf, lay.received() + [lay.owned_part]), ext)
            assert not (coverage(buf, lay.received()) * coverage(buf, [lay.own_box])).any()
            for (e0, e1), (o0, o1), h in zip(lay.extended_box, lay.own_box, lay.halos):
                first = h.own_range[0] - o0  # global plane of buffer index 0
                assert (first + e0, first + e1) == h.in_range
                assert (first + o0, first + o1) == h.own_range
            own_lo = [start for start, _ in lay.own_box]
            assert lay.owned_in_block == tuple((a - o, b - o) for (a, b), o in
                                               zip(lay.owned_part, own_lo))
            assert lay.extended_shape((2, 3)) == (2, 3) + tuple(h.in_range[1] - h.in_range[0]
                                                                for h in lay.halos)
            assert lay.padding == tuple((h.pad_lo, h.pad_hi) for h in lay.halos)
            outputs = [block_range(output_size(n, k, s, *p), g, c) for n, k, s, p, g, c in
                       zip(shape[2:], kernel, stride, padding, grid[2:], coord[2:])]
            assert lay.has_output == all(b > a for a, b in outputs)


def test_compact_owned_moves_the_owned_block_to_the_front_of_the_buffer() -> None:
    """The input gradient of a window layer is its buffer's owned block, made contiguous
    in the buffer's own memory (so the kernels before it need no block-sized copy)."""
    from cosmotrain.layers.windowed import compact_owned

    rng = np.random.default_rng(2)
    boxes = [((1, 6), (1, 5), (0, 5)), ((0, 6), (1, 6), (0, 5)), ((1, 7), (0, 6), (2, 5)),
             ((0, 3), (0, 2), (0, 1)), ((0, 7), (0, 6), (0, 5))]
    for box in boxes:
        buffer = rng.normal(size=(2, 3, 7, 6, 5)).astype(np.float32)
        owned = buffer[box_slices(box)].copy()
        moved = compact_owned(buffer, box)
        np.testing.assert_array_equal(moved, owned)
        assert moved.flags.c_contiguous and np.shares_memory(moved, buffer)
    whole = rng.normal(size=(1, 2, 4, 3, 3))
    assert compact_owned(whole, ((0, 4), (0, 3), (0, 3))).base is whole  # a view, untouched
