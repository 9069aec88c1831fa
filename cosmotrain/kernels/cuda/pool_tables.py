"""The order in which average pooling adds its terms, as tables for ``avgpool.cu``.

Why tables: the CPU kernels add each window's terms in a fixed order (along D, then H,
then W; per dimension the taps whose part covers every output first, then the others,
each in tap order: numpy's ``_window`` / ``_spread`` in ``kernels/pool3d.py``, which
``native/avgpool.c`` follows; D in ascending order on the plane-by-plane path).  That
order is what gives one process's results on every spatial split, so the GPU keeps it.
Working it out in each thread took about 70 integer divisions per output, several times
the cost of the loads; here it is done once per geometry on the host, and the kernel
reads a row of at most 8 indices per dimension.

Layout (int32): the 15 geometry ints (input D, H, W; output D, H, W; kernel; stride;
padding before), the offsets of the D, H and W tables, then the tables: one row of
``k + 1`` ints per output (forward) or per input index (backward): the count, then the
indices in adding order.  Pure: no array module, no device.
"""

from __future__ import annotations

import functools
from typing import Any


def window_order(k: int, s: int, lo: int, n_in: int, n_out: int, j: int) -> list[int]:
    """Inputs in output ``j``'s window along one dimension, in ``_window``'s order."""
    full, partial = [], []
    for e in range(k):
        j0 = max(0, -((e - lo) // s))
        j1 = min(n_out, (n_in - 1 - e + lo) // s + 1)
        if j1 <= j0 or not j0 <= j < j1:
            continue
        (full if j0 == 0 and j1 == n_out else partial).append(j * s + e - lo)
    return full + partial


def spread_order(k: int, s: int, lo: int, n_in: int, n_out: int, i: int) -> list[int]:
    """Outputs whose windows hold input ``i`` along one dimension, in ``_spread``'s order
    (per residue class of ``i`` mod ``s``)."""
    r, m = i % s, i // s
    count = (n_in - r + s - 1) // s
    full, partial = [], []
    for e in range(k):
        q, rem = divmod(r + lo - e, s)
        m0, m1 = max(0, -q), min(count, n_out - q)
        if rem or m1 <= m0 or not m0 <= m < m1:
            continue
        (full if m0 == 0 and m1 == count else partial).append(m + q)
    return full + partial


def _rows(rows: list[list[int]], k: int) -> list[int]:
    flat = []
    for row in rows:
        flat += [len(row)] + row + [0] * (k - len(row))
    return flat


def _dims(pool: Any) -> list[tuple[int, int, int, int, int]]:
    """``(k, s, lo, n_in, n_out)`` per dimension."""
    return [(k, s, lo, n_in, n_out) for k, s, (lo, _), n_in, n_out in
            zip(pool.kernel, pool.stride, pool.padding, pool.x_shape[2:], pool.out)]


def _pack(pool: Any, tables: list[list[int]]) -> tuple[int, ...]:
    head = [*pool.x_shape[2:], *pool.out, *pool.kernel, *pool.stride,
            *(lo for lo, _ in pool.padding)]
    offsets, at = [], len(head) + 3
    for table in tables:
        offsets.append(at)
        at += len(table)
    return tuple(head + offsets + [v for table in tables for v in table])


@functools.lru_cache(maxsize=256)
def _forward(dims: tuple, whole: bool) -> tuple[list[int], ...]:
    tables = []
    for dim, (k, s, lo, n_in, n_out) in enumerate(dims):
        if dim == 0 and not whole:  # the plane-by-plane path: in-range taps ascending
            rows = [[p for p in (z * s + a - lo for a in range(k)) if 0 <= p < n_in]
                    for z in range(n_out)]
        else:
            rows = [window_order(k, s, lo, n_in, n_out, j) for j in range(n_out)]
        tables.append(_rows(rows, k))
    return tuple(tables)


@functools.lru_cache(maxsize=256)
def _backward(dims: tuple, whole: bool) -> tuple[list[int], ...]:
    tables = []
    for dim, (k, s, lo, n_in, n_out) in enumerate(dims):
        if dim == 0 and not whole:  # outputs reading each input plane, ascending
            rows = [[z for z in range(n_out) if 0 <= p + lo - z * s < k] for p in range(n_in)]
        else:
            rows = [spread_order(k, s, lo, n_in, n_out, i) for i in range(n_in)]
        tables.append(_rows(rows, k))
    return tuple(tables)


def forward_table(pool: Any, whole: bool) -> tuple[int, ...]:
    """``avgpool_forward``'s geometry and order tables for ``pool`` (a PoolGeometry)."""
    return _pack(pool, list(_forward(tuple(_dims(pool)), whole)))


def backward_table(pool: Any, whole: bool) -> tuple[int, ...]:
    """``avgpool_backward``'s geometry and order tables for ``pool``."""
    return _pack(pool, list(_backward(tuple(_dims(pool)), whole)))
