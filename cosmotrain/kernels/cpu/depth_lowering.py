"""Depth-window lowering: (H, W) lowered once per input plane, the kernel depth by views.

Plain im2col copies every input plane ``kD*kH*kW`` times per output plane that reads it;
the split lowerings of :mod:`.lowering` copy less but finish with shifted adds over
strided views of the GEMM output, which numpy runs 3-4x slower than contiguous passes
(on conv 4->32 at 128^3 the adds were 31% of the forward).  Here each input plane of a
chunk's depth-major slab is lowered over (H, W) alone, into ``kH*kW*C`` rows; planes are
stored one after another, so the ``kD*kH*kW*C`` rows of output plane ``z`` are the
``kD`` consecutive lowered planes from ``z*sD``: a contiguous block, no copy.  Each
output plane is then one GEMM ``W (F x K) @ cols (K x columns)`` written straight into
the output (forward), or one ``dy (F x columns) @ cols^T`` added into the filter
gradient.  No shifted adds, no grid extension, ``kH*kW`` copies of the input.

Output rows are cut into blocks so that a chunk's lowered planes stay within
``COLS_BYTES`` (cache-sized); the GEMMs are then ``columns = rows * Wo`` wide.  Measured
on the 2-core box (docs/PERFORMANCE.md, "cosmoflow-mlperf per layer against PyTorch"):
forward 4->32 at 128^3 1.6-1.9x faster than the W-split lowering on one core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.geometry import ConvGeometry, plan_chunks
from cosmotrain.kernels.cpu.lowering import depth_slab

# Lowered planes of one chunk's row block (bytes): about what the cache holds.
COLS_BYTES = 4 << 20
# Output planes per chunk: a chunk lowers planes + kD - 1 input planes.
CHUNK_PLANES = 8


@dataclass(frozen=True)
class DepthWindows:
    """A convolution lowered over (H, W) per input plane; depth windows of planes."""

    geo: ConvGeometry

    @property
    def plane_rows(self) -> int:
        """Rows of one lowered input plane: ``C * kH * kW``, ordered (c, b, e)."""
        return self.geo.channels * self.geo.kernel[1] * self.geo.kernel[2]

    @property
    def rows(self) -> int:
        """GEMM reduction ``K = kD * C * kH * kW``, ordered (a, c, b, e)."""
        return self.geo.kernel[0] * self.plane_rows

    def weights(self, w: np.ndarray) -> np.ndarray:
        """``(F, K)`` matrix of ``w[f, c, a, b, e]`` with columns (a, c, b, e)."""
        return np.ascontiguousarray(w.transpose(0, 2, 1, 3, 4)).reshape(self.geo.filters,
                                                                         self.rows)

    def weights_from_matrix(self, g: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`weights`: ``(F, C, kD, kH, kW)``."""
        (kd, kh, kw), c = self.geo.kernel, self.geo.channels
        return g.reshape(self.geo.filters, kd, c, kh, kw).transpose(0, 2, 1, 3, 4)

    def chunks(self) -> list:
        return plan_chunks(self.geo.batch, self.geo.out[0], CHUNK_PLANES)

    def row_blocks(self, planes: int, itemsize: int) -> Iterator[Tuple[int, int]]:
        """Output row ranges whose lowered slab planes take about ``COLS_BYTES``."""
        (sd, _, _), (kd, _, _), (_, ho, wo) = self.geo.stride, self.geo.kernel, self.geo.out
        depth = (planes - 1) * sd + kd
        rows = max(1, COLS_BYTES // (depth * self.plane_rows * wo * itemsize))
        for h0 in range(0, ho, rows):
            yield h0, min(ho, h0 + rows)

    def columns(self, slab: np.ndarray, h0: int, h1: int) -> np.ndarray:
        """``(depth, C*kH*kW, (h1-h0)*Wo)`` lowered slab planes for output rows h0:h1."""
        (_, sh, sw), (_, kh, kw), wo = self.geo.stride, self.geo.kernel, self.geo.out[2]
        shape = (slab.shape[0], self.geo.channels, kh, kw, h1 - h0, wo)
        s_d, s_c, s_h, s_w = slab.strides
        view = as_strided(slab[:, :, h0 * sh:], shape,
                          (s_d, s_c, s_h, s_w, s_h * sh, s_w * sw), writeable=False)
        cols = workers.scratch("window_cols", shape, slab.dtype)
        np.copyto(cols, view)
        return cols.reshape(shape[0], self.plane_rows, -1)

    def window(self, cols: np.ndarray, z: int) -> np.ndarray:
        """``(K, columns)`` column matrix of the chunk's output plane ``z``: a view."""
        start = z * self.geo.stride[0]
        return cols[start:start + self.geo.kernel[0]].reshape(self.rows, -1)


def forward(src: np.ndarray, wmat: np.ndarray, win: DepthWindows, y: np.ndarray,
            bias: Optional[np.ndarray] = None) -> np.ndarray:
    """``y = conv(src) (+ bias)`` with the weight matrix ``wmat = win.weights(w)``."""
    f = win.geo.filters

    def work(chunk) -> None:
        n, z0, z1 = chunk
        slab = depth_slab(win.geo, src[n], z0, z1)
        for h0, h1 in win.row_blocks(z1 - z0, src.itemsize):
            cols = win.columns(slab, h0, h1)
            for z in range(z1 - z0):
                block = y[n, :, z0 + z, h0:h1].reshape(f, -1)
                np.matmul(wmat, win.window(cols, z), out=block)
                if bias is not None:  # while the block is in cache
                    np.add(block, bias[:, None], out=block)

    workers.map_chunks(work, win.chunks())
    return y


def filter_grad(x: np.ndarray, dy: np.ndarray, win: DepthWindows) -> np.ndarray:
    """``dL/dw`` as ``(F, C, kD, kH, kW)`` (partials summed in chunk order)."""
    f = win.geo.filters

    def work(chunk) -> np.ndarray:
        n, z0, z1 = chunk
        slab = depth_slab(win.geo, x[n], z0, z1)
        total = np.zeros((f, win.rows), x.dtype)
        part = workers.scratch("window_part", (f, win.rows), x.dtype)
        for h0, h1 in win.row_blocks(z1 - z0, x.itemsize):
            cols = win.columns(slab, h0, h1)
            for z in range(z1 - z0):
                grad = dy[n, :, z0 + z, h0:h1].reshape(f, -1)
                np.matmul(grad, win.window(cols, z).T, out=part)
                total += part
        return total

    g = workers.sum_in_order(workers.map_chunks(work, win.chunks()))
    return np.ascontiguousarray(win.weights_from_matrix(g))
