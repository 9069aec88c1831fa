"""Data gradient of a strided 3D convolution by col2im (scatter).

Unit-stride convolutions compute dx as a gather (a convolution of dy, see
:func:`.conv3d.conv3d_backward_data`), which is faster: col2im needs ``kD*kH*kW``
strided read-modify-write adds of the whole gradient (65 of 137 ms for conv 4->16 at
128^3).  With stride > 1 the gather would run on a zero-dilated dy, wasting
``sD*sH*sW`` of the GEMM, so strided layers (CosmoFlow conv4, small) scatter instead:
``cols = W^T @ dy`` per chunk, added into a zero-padded dx.  Chunks run in two phases
(even, then odd) so that concurrently running chunks never add into the same planes.
"""

from __future__ import annotations

import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.geometry import ConvGeometry, plan_chunks
from cosmotrain.kernels.cpu.lowering import planes_view


def col2im_add(cols: np.ndarray, dxp_n: np.ndarray, geo: ConvGeometry, d0: int, d1: int) -> None:
    """Add the column matrix of output planes d0:d1 into the padded gradient ``dxp_n``.

    One strided add per kernel offset (the offsets' target views overlap each other, so
    they cannot be fused into one ufunc call).
    """
    (stD, stH, stW), (_, ho, wo) = geo.stride, geo.out
    s = d1 - d0
    cols7 = cols.reshape((geo.channels,) + geo.kernel + (s, ho, wo))
    for a in range(geo.kernel[0]):
        za = d0 * stD + a
        for b in range(geo.kernel[1]):
            for e in range(geo.kernel[2]):
                dst = dxp_n[:, za:za + (s - 1) * stD + 1:stD,
                            b:b + (ho - 1) * stH + 1:stH,
                            e:e + (wo - 1) * stW + 1:stW]
                np.add(dst, cols7[:, a, b, e], out=dst)


def backward_data_scatter(dy: np.ndarray, w: np.ndarray, geo: ConvGeometry,
                          budget: int, dx: np.ndarray) -> np.ndarray:
    """dx (written into ``dx``) for any stride and padding."""
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(geo.spatial, geo.padding))
    dxp = np.zeros((geo.batch, geo.channels) + padded, dtype=dy.dtype)
    wt = w.reshape(geo.filters, geo.rows).T

    def work(chunk):
        n, d0, d1 = chunk
        cols = workers.scratch("cols", (geo.rows, (d1 - d0) * geo.plane), dy.dtype)
        np.matmul(wt, planes_view(dy[n], d0, d1), out=cols)
        col2im_add(cols, dxp[n], geo, d0, d1)

    # Chunk i+1 separates chunks i and i+2 in the input when it has >= kD/sD - 1 planes.
    k, s = geo.kernel[0], geo.stride[0]
    chunks = plan_chunks(geo.batch, geo.out[0], budget // (geo.rows * geo.plane * dy.itemsize),
                         min_planes=max(1, -(-k // s) - 1))
    for phase in (0, 1):
        workers.map_chunks(work, [c for i, c in enumerate(chunks) if i % 2 == phase])
    (dl, _), (hl, _), (wl, _) = geo.padding
    d, h, w_ = geo.spatial
    np.copyto(dx, dxp[:, :, dl:dl + d, hl:hl + h, wl:wl + w_])
    return dx
