"""Layers that act on each element (or channel) of a block: the serial code on ``.data``.

Activations, batch norm (once its sums are reduced) and dropout need no halo: on a
:class:`DistTensor` they run the single-process layer on the local block and wrap the
result in the same distribution.  Dropout additionally places the block in the global
tensor, so that its mask is the one a single process draws for those elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosmotrain.nn.layers import Dropout, LeakyReLU
from cosmotrain.nn.module import Context, Layer
from cosmotrain.tensor.dist_tensor import DistTensor


class OnBlocks:
    """Mixin before a shape-preserving serial layer: unwrap, run, rewrap."""

    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:
        y = super().forward(x.data, ctx)  # type: ignore[misc]
        return DistTensor(y, x.dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:
        dx = super().backward(dy.data, ctx)  # type: ignore[misc]
        return None if dx is None else DistTensor(dx, dy.dist, dy.coord)


@dataclass
class SpatialLeakyReLU(OnBlocks, LeakyReLU):
    """:class:`LeakyReLU` on a block."""


@dataclass
class SpatialDropout(OnBlocks, Dropout):
    """:class:`Dropout` on a block, masked by the elements' global indices."""

    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:
        self._block = x  # read by block_geometry, during this call only
        try:
            return super().forward(x, ctx)
        finally:
            self._block = None

    def block_geometry(self, x: Any, ctx: Context) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self._block.offset, self._block.dist.global_shape


def blockwise(layer: Layer) -> Layer:
    """The block twin of an activation or dropout layer."""
    if isinstance(layer, LeakyReLU):
        return SpatialLeakyReLU(name=layer.name, slope=layer.slope,
                                needs_input_grad=layer.needs_input_grad)
    if isinstance(layer, Dropout):
        return SpatialDropout(name=layer.name, p=layer.p, needs_input_grad=layer.needs_input_grad)
    raise TypeError(f"{type(layer).__name__} has no block-wise twin")
