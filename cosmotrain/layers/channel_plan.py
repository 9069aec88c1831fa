"""Which channel/filter algorithm each convolution uses (``parallel.channel_algorithm``).

``auto`` takes, per layer, the algorithm of least communication volume
(:func:`~cosmotrain.tensor.channel_split.comm_volume`) for that layer's shapes on this
grid; ``parallel.layers.<name>`` overrides the algorithm (and, for stationary-w, how
the group is factored) of one convolution.  Pure: every rank computes the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from cosmotrain.config.schema import AUTO
from cosmotrain.errors import ConfigError
from cosmotrain.nn.containers import Residual, Sequential
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Layer, layer_path
from cosmotrain.tensor.channel_split import (Factor, algorithm_factor, choose_algorithm,
                                             halo_elements)


@dataclass(frozen=True)
class LayerChoice:
    """One convolution's algorithm and the factorisation of the group it implies."""

    algorithm: str
    factor: Factor


def conv_inputs(layer: Layer, shape: tuple[int, ...], prefix: str = ""
                ) -> Iterator[tuple[str, Conv3d, tuple[int, ...]]]:
    """``(dotted name, convolution, input shape)`` of every convolution inside ``layer``."""
    path = layer_path(prefix, layer.name)
    inner = f"{path}." if path else ""
    if isinstance(layer, Conv3d):
        yield path, layer, shape
    elif isinstance(layer, Sequential):
        for item in layer.items:
            yield from conv_inputs(item, shape, inner)
            shape = item.output_shape(shape)
    elif isinstance(layer, Residual):  # body and shortcut read the block's input
        for child in (layer.body, layer.shortcut):
            if child is not None:
                yield from conv_inputs(child, shape, inner)


def plan_channels(layers: list[Layer], input_shape: tuple[int, ...], grid: Factor,
                  spatial_ways: tuple[int, int, int], sample_ways: int, default: str,
                  overrides: Mapping[str, Any]) -> dict[str, LayerChoice]:
    """The choice for every convolution of ``layers`` (the model's block-parallel part)."""
    region = Sequential(items=list(layers))
    choices = {}
    for name, conv, shape in conv_inputs(region, input_shape):
        override = overrides.get(name)
        algorithm = getattr(override, "algorithm", None) or default
        factor = _override_factor(name, override, grid)
        if algorithm == AUTO:  # the network's first layer computes no input gradient
            algorithm = _cheapest(conv, shape, grid, spatial_ways, sample_ways,
                                  input_grad=conv is not region.items[0])
        choices[name] = LayerChoice(algorithm, factor if algorithm == "w" and factor
                                    else algorithm_factor(algorithm, grid))
    unknown = sorted(set(overrides) - set(choices))
    if unknown:
        raise ConfigError(f"parallel.layers.{unknown[0]}", "names no convolution that runs "
                          "channel/filter parallel", "use one of: " + ", ".join(choices)
                          if choices else "remove it (no layer is channel/filter parallel)")
    return choices


def _override_factor(name: str, override: Any, grid: Factor) -> Factor | None:
    """The ``channel x filter`` factorisation a layer override asks for, validated."""
    ways = getattr(override, "channel", None)
    if ways is None:
        return None
    if grid.size % ways:
        raise ConfigError(f"parallel.layers.{name}.channel", f"{ways} does not divide the "
                          f"channel/filter group of {grid.size} rank(s)",
                          f"use a divisor of {grid.size}")
    return Factor(ways, grid.size // ways)


def _cheapest(conv: Conv3d, shape: tuple[int, ...], grid: Factor,
              spatial_ways: tuple[int, int, int], sample_ways: int, input_grad: bool) -> str:
    """The algorithm of least communication volume for this layer on this grid."""
    block = [size / ways for size, ways in zip(shape[2:], spatial_ways)]
    samples = shape[0] / sample_ways
    out = conv.output_shape(shape)
    out_block = [size / ways for size, ways in zip(out[2:], spatial_ways)]
    return choose_algorithm(conv.in_channels, conv.out_channels, samples * math.prod(block),
                            samples * math.prod(out_block),
                            samples * halo_elements(block, conv.kernel, spatial_ways), grid,
                            input_grad)
