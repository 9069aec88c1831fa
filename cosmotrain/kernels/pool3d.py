"""3D average and max pooling, forward and backward, with asymmetric padding.

Average pooling counts the zero padding in its divisor (PyTorch's ``count_include_pad``,
LBANN's behaviour), so its window sum is separable: summing along W, then H, then D costs
3k strided additions instead of k^3, and backward is the same three steps transposed.
Max pooling pads with -inf and records, per output, the offset of the winning element
within its window (int16), which is all backward needs.  Ties go to the first element in
window order, as in PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product
from typing import Any

from cosmotrain.backend import array_module
from cosmotrain.kernels.geometry import (PaddingLike, Triple, normalize_padding,
                                         normalize_triple, output_shape)


def _geometry(shape: Sequence[int], kernel: Any, stride: Any, padding: PaddingLike
              ) -> tuple[Triple, Triple, Any, Triple]:
    k = normalize_triple(kernel, "kernel")
    s = normalize_triple(stride, "stride")
    pad = normalize_padding(padding)
    return k, s, pad, output_shape(shape[2:], k, s, pad)


def _pad(x: Any, pad: Any, value: float) -> Any:
    if not any(lo or hi for lo, hi in pad):
        return x
    xp = array_module(x)
    return xp.pad(x, ((0, 0), (0, 0)) + tuple(pad), constant_values=value)


def _taps(offset: int, out: int, stride: int) -> slice:
    """The input positions that window offset ``offset`` reads for ``out`` outputs."""
    return slice(offset, offset + stride * (out - 1) + 1, stride)


def _crop(xp_grad: Any, pad: Any) -> Any:
    index = tuple(slice(lo, xp_grad.shape[2 + d] - hi) for d, (lo, hi) in enumerate(pad))
    return xp_grad[(..., *index)]


def avg_pool3d_forward(x: Any, kernel: Any, stride: Any, padding: PaddingLike) -> Any:
    """Mean over each window, padding counted (divisor always kD * kH * kW)."""
    k, s, pad, out = _geometry(x.shape, kernel, stride, padding)
    total = _pad(x, pad, 0.0)
    for axis in (4, 3, 2):  # W, H, D: separable window sums
        d = axis - 2
        total = sum(total[(..., *_axis_index(axis, _taps(o, out[d], s[d])))]
                    for o in range(k[d]))
    return total * x.dtype.type(1.0 / (k[0] * k[1] * k[2]))


def _axis_index(axis: int, index: slice) -> tuple[slice, ...]:
    """An index tuple (after the leading ``...``) selecting ``index`` along ``axis`` of 5."""
    return (slice(None),) * (axis - 2) + (index,) + (slice(None),) * (4 - axis)


def avg_pool3d_backward(dy: Any, x_shape: Sequence[int], kernel: Any, stride: Any,
                        padding: PaddingLike) -> Any:
    """The transpose of the separable sums, scaled by 1 / (kD * kH * kW)."""
    xp = array_module(dy)
    k, s, pad, out = _geometry(x_shape, kernel, stride, padding)
    padded = [x_shape[2 + d] + pad[d][0] + pad[d][1] for d in range(3)]
    grad = dy * dy.dtype.type(1.0 / (k[0] * k[1] * k[2]))
    for axis in (2, 3, 4):  # undo D, then H, then W
        d = axis - 2
        shape = list(grad.shape)
        shape[axis] = padded[d]
        spread = xp.zeros(shape, dtype=dy.dtype)
        for o in range(k[d]):
            spread[(..., *_axis_index(axis, _taps(o, out[d], s[d])))] += grad
        grad = spread
    return xp.ascontiguousarray(_crop(grad, pad))


def _windows(padded: Any, k: Triple, s: Triple, out: Triple):
    """(window offset index, strided view) for every offset of the kernel window."""
    for index, (a, b, c) in enumerate(product(range(k[0]), range(k[1]), range(k[2]))):
        yield index, (a, b, c), padded[..., _taps(a, out[0], s[0]), _taps(b, out[1], s[1]),
                                       _taps(c, out[2], s[2])]


def max_pool3d_forward(x: Any, kernel: Any, stride: Any, padding: PaddingLike
                       ) -> tuple[Any, Any]:
    """(max over each window, int16 offset of the winner within the window)."""
    xp = array_module(x)
    k, s, pad, out = _geometry(x.shape, kernel, stride, padding)
    padded = _pad(x, pad, -float("inf"))
    y = xp.full(x.shape[:2] + out, -xp.inf, dtype=x.dtype)
    argmax = xp.zeros(y.shape, dtype=xp.int16)
    for index, _, view in _windows(padded, k, s, out):
        better = view > y
        xp.copyto(y, view, where=better)
        argmax[better] = index
    return y, argmax


def max_pool3d_backward(dy: Any, argmax: Any, x_shape: Sequence[int], kernel: Any,
                        stride: Any, padding: PaddingLike) -> Any:
    """Route each output gradient to the element that won its window."""
    xp = array_module(dy)
    k, s, pad, out = _geometry(x_shape, kernel, stride, padding)
    padded_shape = tuple(x_shape[:2]) + tuple(x_shape[2 + d] + pad[d][0] + pad[d][1]
                                              for d in range(3))
    grad = xp.zeros(padded_shape, dtype=dy.dtype)
    for index, _, view in _windows(grad, k, s, out):
        view += xp.where(argmax == index, dy, dy.dtype.type(0))
    return xp.ascontiguousarray(_crop(grad, pad))
