"""Operand buffers of the cuDNN graphs: NCDHW arrays <-> buffers in the graph's layout.

Pure array-module code (numpy or cupy alike), so the layout round trips are tested on the
CPU; :mod:`.conv_cudnn` describes the same layouts to cuDNN.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

from cosmotrain.kernels.geometry import Padding


def extended_shape(shape: Sequence[int], extend: Padding) -> Tuple[int, ...]:
    """``(N, C, D', H', W')``: an NCDHW shape grown by the zero extension."""
    spatial = tuple(n + lo + hi for n, (lo, hi) in zip(shape[2:], extend))
    return tuple(shape[:2]) + spatial


def to_layout(xp: Any, a: Any, layout: str, extend: Optional[Padding] = None) -> Any:
    """``a`` (logical NCDHW) as a contiguous buffer in ``layout``, zero-extended.

    No copy for an NCDHW-contiguous ``a`` in the ``ncdhw`` layout without extension.
    """
    view = a.transpose(0, 2, 3, 4, 1) if layout == "ndhwc" else a
    if extend is None or not any(lo or hi for lo, hi in extend):
        return xp.ascontiguousarray(view)
    dims = extended_shape(a.shape, extend)
    buf = empty_buffer(xp, dims, layout, a.dtype, zero=True)
    inner = tuple(slice(lo, lo + n) for (lo, _), n in zip(extend, a.shape[2:]))
    if layout == "ndhwc":
        buf[(slice(None),) + inner] = view
    else:
        buf[(slice(None), slice(None)) + inner] = view
    return buf


def empty_buffer(xp: Any, dims: Sequence[int], layout: str, dtype: Any,
                 zero: bool = False) -> Any:
    """A buffer for logical dims ``(N, C, D, H, W)`` stored in ``layout``."""
    n, c, d, h, w = dims
    shape = (n, d, h, w, c) if layout == "ndhwc" else (n, c, d, h, w)
    return (xp.zeros if zero else xp.empty)(shape, dtype=dtype)


def from_layout(xp: Any, buf: Any, layout: str, crop: Optional[Padding] = None) -> Any:
    """The NCDHW-contiguous array held by ``buf``, without the zero extension ``crop``."""
    view = buf.transpose(0, 4, 1, 2, 3) if layout == "ndhwc" else buf
    if crop is not None:
        index = tuple(slice(lo, n - hi) for (lo, hi), n in zip(crop, view.shape[2:]))
        view = view[(slice(None), slice(None)) + index]
    return xp.ascontiguousarray(view)
