"""Max pooling whose 2x2x2 windows tile the input (kernel = stride = 2, no padding).

This is the MLPerf network's pooling, after every convolution; on its first layer it
reads a 32 x 128^3 tensor per sample.  The general kernels of :mod:`.pool3d` find the
argmax by comparing each of the 8 taps with the maximum (16 passes over strided views of
the input) and route the gradient with ``np.bincount`` in float64; here each pass is over
contiguous arrays, which numpy runs 3-5x faster than over views whose innermost stride
is 2 (measured on the 2-core box: ``np.maximum`` of two stride-2 views of 64 Ki floats
66 us, of contiguous ones 13 us; a multiply into a stride-8 view 223 us, into a
contiguous one 13 us, a plain copy into it 37 us).

Forward, per block of channels and output planes: the even and odd input columns are
copied apart (the only strided reads), then pairs are reduced along W, H and D in that
order, each giving the maximum and a "the second is larger" bit.  Reducing the innermost
tap first and the depth tap last settles ties for the first offset ``(a*2 + b)*2 + e``,
as the general kernel and PyTorch do; the bits of the taps chosen at each step make the
argmax with a few boolean selections.  NaN compares false, so a block whose maximum holds
a NaN takes the general rule (its first NaN).  Backward: each of the 8 taps'
gradients ``dy * (argmax == k)`` is written straight into its strided view of ``dx``
(computing them contiguously and interleaving them with one transposing copy measured
2.7x slower); each input element belongs to one window, so nothing is summed and no
zero fill is needed (rows and planes left over by an odd size are zeroed).  A block whose
``dy`` is not finite routes it exactly (``0 * inf`` must not leak into the other taps).

float32 blocks go to compiled loops instead (``native/maxpool.c``, through
:mod:`.compiled`) when the install built them: one read of each window, one write of
each input gradient element, the same maxima, offsets and gradients bit for bit
(tests/test_pool3d.py runs both).  MLPerf W=128 batch 2, first pooling (2 threads,
heap reuse, 2026-11-27): forward 200 -> 60 ms, backward 118 -> 77 ms.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import library as compiled

# float32 blocks take the compiled loops when the install built them (False: the numpy
# passes below only; the tests run both).
USE_COMPILED = True

# Input bytes per block of work (channels x output planes of one sample).
BLOCK_BYTES = 1 << 20

Block = Tuple[int, int, int, int, int]  # sample, channels c0:c1, output planes z0:z1


def applies(kernel, stride, padding) -> bool:
    """Whether a max pooling is 2x2x2 windows that tile the input."""
    return (tuple(kernel) == (2, 2, 2) and tuple(stride) == (2, 2, 2)
            and all(lo == 0 and hi == 0 for lo, hi in padding))


def blocks(x_shape, itemsize: int) -> List[Block]:
    """Blocks of about ``BLOCK_BYTES`` of input: whole channels when they are small."""
    n, c, d, h, w = x_shape
    plane_pair = 2 * h * w * itemsize
    zs = d // 2
    planes = max(1, min(zs, BLOCK_BYTES // plane_pair))
    channels = max(1, BLOCK_BYTES // (plane_pair * zs)) if planes == zs else 1
    return [(i, c0, min(c, c0 + channels), z0, min(zs, z0 + planes))
            for i in range(n) for c0 in range(0, c, channels) for z0 in range(0, zs, planes)]


@functools.lru_cache(maxsize=1)
def _loops() -> Optional[Tuple[Callable, Callable]]:
    """``(forward, backward)`` of ``native/maxpool.c``, or None without the library."""
    pointer, three, sizes = compiled.POINTER, [compiled.LONG] * 3, [compiled.INT] * 4
    return compiled.functions(
        ("cosmotrain_maxpool2_forward", [pointer, *three, pointer, pointer, *three, *sizes]),
        ("cosmotrain_maxpool2_backward", [pointer, pointer, *three, pointer, *three, *sizes]))


def _compiled(dtype) -> Optional[Tuple[Callable, Callable]]:
    return _loops() if USE_COMPILED and dtype == np.float32 else None


def _strides(a: np.ndarray) -> Tuple[int, int, int]:
    """Element strides of channels, planes and rows (of a sample's block)."""
    return compiled.element_strides(a)[1:4]  # type: ignore[return-value]


def _select(which: np.ndarray, one: np.ndarray, zero: np.ndarray, out: np.ndarray) -> None:
    """``out = one if which else zero`` on booleans, with bitwise operations."""
    np.bitwise_xor(one, zero, out=out)
    np.bitwise_and(out, which, out=out)
    np.bitwise_xor(out, zero, out=out)


def _pairs(a: np.ndarray, axis: int, out: np.ndarray, larger: np.ndarray) -> None:
    """``out = max`` of the pairs along ``axis``; ``larger``: the second one is larger."""
    first = a[(slice(None),) * axis + (slice(0, None, 2),)]
    second = a[(slice(None),) * axis + (slice(1, None, 2),)]
    np.maximum(first, second, out=out)
    np.greater(second, first, out=larger)


def forward(x: np.ndarray, y: np.ndarray, arg: np.ndarray) -> None:
    """``y`` (maxima) and ``arg`` (int8 offsets) of the pooling of ``x``."""
    _, _, zs, hs, ws = y.shape
    loops = _compiled(x.dtype)

    def work(block: Block) -> None:
        n, c0, c1, z0, z1 = block
        xb = x[n, c0:c1, 2 * z0:2 * z1, :2 * hs, :2 * ws]
        yb, ab = y[n, c0:c1, z0:z1], arg[n, c0:c1, z0:z1]
        if loops is not None:
            loops[0](compiled.address(xb), *_strides(x), compiled.address(yb),
                     compiled.address(ab), *_strides(y), c1 - c0, z1 - z0, hs, ws)
            return
        cb, zb = c1 - c0, z1 - z0
        cols = workers.scratch("mp_cols", (2, cb, 2 * zb, 2 * hs, ws), x.dtype)
        np.copyto(cols[0], xb[..., 0::2])
        np.copyto(cols[1], xb[..., 1::2])
        rows = workers.scratch("mp_w", (cb, 2 * zb, 2 * hs, ws), x.dtype)
        bits_w = workers.scratch("mp_bw", rows.shape, bool)
        np.maximum(cols[0], cols[1], out=rows)
        np.greater(cols[1], cols[0], out=bits_w)
        planes = workers.scratch("mp_h", (cb, 2 * zb, hs, ws), x.dtype)
        bits_h = workers.scratch("mp_bh", planes.shape, bool)
        _pairs(rows, 2, planes, bits_h)
        bits_d = workers.scratch("mp_bd", yb.shape, bool)
        _pairs(planes, 1, yb, bits_d)
        if np.isnan(yb).any():
            _exact_argmax(xb, yb, ab)
            return
        _offsets(bits_d, bits_h.reshape(cb, zb, 2, hs, ws),
                 bits_w.reshape(cb, zb, 2, hs, 2, ws), ab)

    workers.map_chunks(work, blocks(x.shape, x.itemsize))


def _offsets(a: np.ndarray, bits_h: np.ndarray, bits_w: np.ndarray, out: np.ndarray) -> None:
    """``out = 4a + 2b + e`` from the depth bits ``a``, the H bits of both depth taps and
    the W bits of all four (D, H) taps: b and e are the bits of the taps chosen."""
    b = workers.scratch("mp_b", a.shape, bool)
    _select(a, bits_h[:, :, 1], bits_h[:, :, 0], b)
    half = workers.scratch("mp_e2", bits_w[:, :, 0].shape, bool)  # (cb, zb, hs, 2, ws)
    _select(a[:, :, :, None, :], bits_w[:, :, 1], bits_w[:, :, 0], half)
    e = workers.scratch("mp_e", a.shape, bool)
    _select(b, half[:, :, :, 1], half[:, :, :, 0], e)
    np.multiply(a.view(np.int8), 4, out=out)
    np.add(out, b.view(np.int8), out=out)
    np.add(out, b.view(np.int8), out=out)
    np.add(out, e.view(np.int8), out=out)


def _taps(xb: np.ndarray):
    """``(offset, view of the tap's inputs)``, last offset first."""
    for offset in range(7, -1, -1):
        a, b, e = offset >> 2, (offset >> 1) & 1, offset & 1
        yield offset, xb[:, a::2, b::2, e::2]


def _exact_argmax(xb: np.ndarray, yb: np.ndarray, ab: np.ndarray) -> None:
    """The general rule: the first tap equal to the maximum, else (NaN) the first NaN."""
    for offset, tap in _taps(xb):
        np.copyto(ab, offset, where=tap == yb)
    for offset, tap in _taps(xb):
        np.copyto(ab, offset, where=np.isnan(tap))


def backward(dy: np.ndarray, arg: np.ndarray, dx: np.ndarray) -> None:
    """``dx`` = ``dy`` routed to each window's argmax tap (``dx`` fully written)."""
    _, _, zs, hs, ws = dy.shape
    _zero_leftovers(dx, zs, hs, ws)
    loops = _compiled(dy.dtype)

    def work(block: Block) -> None:
        n, c0, c1, z0, z1 = block
        gb, ab = dy[n, c0:c1, z0:z1], arg[n, c0:c1, z0:z1]
        dxb = dx[n, c0:c1, 2 * z0:2 * z1, :2 * hs, :2 * ws]
        if loops is not None:
            loops[1](compiled.address(gb), compiled.address(ab), *_strides(dy),
                     compiled.address(dxb), *_strides(dx), c1 - c0, z1 - z0, hs, ws)
            return
        if not np.isfinite(gb).all():
            dxb.fill(0)
            for offset, tap in _taps(dxb):
                np.copyto(tap, gb, where=ab == offset)
            return
        mask = workers.scratch("mp_mask", gb.shape, bool)
        for offset, tap in _taps(dxb):
            np.equal(ab, offset, out=mask)
            np.multiply(gb, mask, out=tap)

    workers.map_chunks(work, blocks(dx.shape, dx.itemsize))


def _zero_leftovers(dx: np.ndarray, zs: int, hs: int, ws: int) -> None:
    """Zero the last plane, row or column of an odd-sized input (in no window)."""
    dx[:, :, 2 * zs:] = 0
    dx[:, :, :, 2 * hs:] = 0
    dx[..., 2 * ws:] = 0
