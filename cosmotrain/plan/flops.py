"""FLOP and activation-memory arithmetic of a network, layer by layer, from its shapes.

Convolutions and linear layers count 2 FLOPs per multiply-add; backward is dgrad + wgrad
(twice the forward), as in REFERENCE.md's 18.5 / 55.6 GFLOP per 128^3 CosmoFlow sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cosmotrain.nn.containers import Residual, Sequential
from cosmotrain.nn.layers import Conv3d, Linear
from cosmotrain.nn.module import Layer, layer_path


@dataclass(frozen=True)
class LayerCost:
    name: str
    kind: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    forward_flops: int

    @property
    def backward_flops(self) -> int:
        return 2 * self.forward_flops


def layer_costs(model: Layer, input_shape: tuple[int, ...]) -> list[LayerCost]:
    """One entry per leaf layer, in execution order, for an input of ``input_shape``."""
    costs: list[LayerCost] = []
    _walk(model, input_shape, "", costs)
    return costs


def _walk(layer: Layer, shape: tuple[int, ...], prefix: str, out: list[LayerCost]
          ) -> tuple[int, ...]:
    name = layer_path(prefix, layer.name)
    base = f"{name}." if name else ""
    if isinstance(layer, Sequential):
        for child in layer.items:
            shape = _walk(child, shape, base, out)
        return shape
    if isinstance(layer, Residual):
        result = _walk(layer.body, shape, base, out)
        if layer.shortcut is not None:
            _walk(layer.shortcut, shape, base, out)
        return _walk(layer.post, result, base, out) if layer.post is not None else result
    out_shape = layer.output_shape(shape)
    out.append(LayerCost(name, type(layer).__name__, shape, out_shape,
                         _forward_flops(layer, shape, out_shape)))
    return out_shape


def _forward_flops(layer: Layer, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
                   ) -> int:
    if isinstance(layer, Conv3d):
        return 2 * math.prod(out_shape) * layer.in_channels * math.prod(layer.kernel)
    if isinstance(layer, Linear):
        return 2 * in_shape[0] * layer.in_features * layer.out_features
    return 0


def training_flops(model: Layer, input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of one step on ``input_shape``."""
    forward = sum(c.forward_flops for c in layer_costs(model, input_shape))
    return forward, 3 * forward
