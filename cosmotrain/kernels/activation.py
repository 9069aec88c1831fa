"""LeakyReLU, in place: the backward pass needs only the sign, which the output keeps.

Working in place means the activation costs no extra memory: the convolution's output
buffer becomes the activation's output and is the only tensor kept for backward.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.backend import array_module


def leaky_relu_forward(x: Any, slope: float, inplace: bool = True) -> Any:
    """``max(x, 0) + slope * min(x, 0)``; overwrites ``x`` when ``inplace``."""
    xp = array_module(x)
    y = x if inplace else x.copy()
    negative = y < 0
    xp.multiply(y, x.dtype.type(slope), out=y, where=negative)
    return y


def leaky_relu_backward(dy: Any, y: Any, slope: float, inplace: bool = True) -> Any:
    """dx = dy where y > 0 else slope * dy (valid for slope > 0 and for slope = 0)."""
    xp = array_module(dy)
    dx = dy if inplace else dy.copy()
    xp.multiply(dx, dy.dtype.type(slope), out=dx, where=y <= 0)
    return dx
