"""A hybrid sample x spatial parallel model built from a single-process one.

The serial network's top-level layers are cut in two at the *spatial stop*: the layers
before it become their spatial twins (convolution and pooling with halos, block-wise
activations / batch norm / dropout) and run on :class:`DistTensor` blocks; a
:class:`ToSamples` all-to-all then hands whole samples to the rest of the network, which
runs data parallel.  Parameters are the serial model's own objects under the same names,
so initialisation, checkpoints and the optimizer do not know the difference.

Where to stop (``parallel.spatial_until``): ``auto`` stops at the first layer that cannot
run on blocks (flatten, global pooling, linear) or the first convolution or pooling
whose input block along a split dimension is thinner than :data:`MIN_BLOCK_PLANES` planes: below that a k3 halo is half
the block, exchanging it costs as much as computing it, and whole samples are cheaper.
A layer name stops there instead.  With no spatial split the whole network is data
parallel.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.schema import AUTO
from cosmotrain.errors import ConfigError
from cosmotrain.layers.batchnorm import dist_batchnorm
from cosmotrain.layers.blockwise import blockwise
from cosmotrain.layers.conv import spatial_conv
from cosmotrain.layers.pool import spatial_pool
from cosmotrain.layers.to_samples import ToSamples
from cosmotrain.nn.containers import Residual, Sequential
from cosmotrain.nn.layers import BatchNorm3d, Conv3d, Dropout, LeakyReLU, Pool3d
from cosmotrain.nn.module import Context, Layer, Parameter
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution

MIN_BLOCK_PLANES = 4
BN_GROUPS = {"global": "data", "local": "spatial"}


def runs_on_blocks(layer: Layer) -> bool:
    """Whether ``layer`` (and everything inside it) has a spatial twin."""
    if isinstance(layer, (Sequential, Residual)):
        return all(runs_on_blocks(child) for child in layer.children())
    return isinstance(layer, (Conv3d, Pool3d, BatchNorm3d, LeakyReLU, Dropout))


def spatial_stop(model: Sequential, input_shape: tuple[int, ...], ways: tuple[int, int, int],
                 until: str = AUTO) -> int:
    """Index of the first top-level layer that runs on whole samples."""
    names = [layer.name for layer in model.items]
    if until != AUTO:
        return _named_stop(model, names, until)
    if all(w == 1 for w in ways):
        return 0
    shape = input_shape
    for index, layer in enumerate(model.items):
        thinnest = min(size // w for size, w in zip(shape[2:], ways) if w > 1)
        if not runs_on_blocks(layer) or (has_window(layer) and thinnest < MIN_BLOCK_PLANES):
            return index
        shape = layer.output_shape(shape)
    return len(model.items)


def has_window(layer: Layer) -> bool:
    """Whether ``layer`` contains a convolution or pooling (a layer with halos)."""
    return any(isinstance(sub, (Conv3d, Pool3d)) for sub in layer.layers())


def _named_stop(model: Sequential, names: list[str], until: str) -> int:
    if until not in names:
        raise ConfigError("parallel.spatial_until", f"the model has no top-level layer "
                          f"{until!r}", f"use auto or one of: {', '.join(names)}")
    index = names.index(until)
    for layer in model.items[:index]:
        if not runs_on_blocks(layer):
            raise ConfigError("parallel.spatial_until", f"layer {layer.name!r} before "
                              f"{until!r} cannot run on spatial blocks",
                              f"stop at or before {layer.name!r}")
    return index


def spatial_twin(layer: Layer, grid: ProcessGrid, bn_comm: Any) -> Layer:
    """The layer's twin on spatial blocks, sharing its parameters."""
    if isinstance(layer, Conv3d):
        return spatial_conv(layer, grid)
    if isinstance(layer, Pool3d):
        return spatial_pool(layer, grid)
    if isinstance(layer, BatchNorm3d):
        return dist_batchnorm(layer, bn_comm, grid.timers, spatial=True)
    if isinstance(layer, (LeakyReLU, Dropout)):
        return blockwise(layer)
    return _map_children(layer, lambda child: spatial_twin(child, grid, bn_comm))


def sample_twin(layer: Layer, grid: ProcessGrid, bn_comm: Any) -> Layer:
    """The layer for whole local samples: batch norm reduces its sums, the rest is serial."""
    if isinstance(layer, BatchNorm3d):
        return dist_batchnorm(layer, bn_comm, grid.timers, spatial=False)
    if isinstance(layer, (Sequential, Residual)):
        return _map_children(layer, lambda child: sample_twin(child, grid, bn_comm))
    return layer


def _map_children(layer: Layer, twin: Any) -> Layer:
    if isinstance(layer, Sequential):
        return Sequential(name=layer.name, items=[twin(c) for c in layer.items],
                          needs_input_grad=layer.needs_input_grad)
    if isinstance(layer, Residual):
        return Residual(name=layer.name, body=twin(layer.body),
                        shortcut=None if layer.shortcut is None else twin(layer.shortcut),
                        post=None if layer.post is None else twin(layer.post),
                        needs_input_grad=layer.needs_input_grad)
    raise TypeError(f"{type(layer).__name__} {layer.name!r} cannot run on spatial blocks")


@dataclass
class HybridModel:
    """Spatial part on blocks -> :class:`ToSamples` -> data-parallel head."""

    spatial: Sequential
    to_samples: ToSamples
    head: Sequential
    grid: ProcessGrid

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        yield from self.spatial.named_parameters()
        yield from self.head.named_parameters()

    def named_buffers(self) -> Iterator[tuple[str, Layer, str]]:
        yield from self.spatial.named_buffers()
        yield from self.head.named_buffers()

    @property
    def stop(self) -> str:
        """Name of the first layer on whole samples ('' when every layer is spatial)."""
        return self.head.items[0].name if self.head.items else ""

    def input_distribution(self, input_shape: tuple[int, ...]) -> tuple[Distribution,
                                                                       tuple[int, ...]]:
        """How a mini-batch of ``input_shape`` (N, C, D, H, W) is cut, and my block."""
        grid = self.grid
        dist = Distribution(input_shape, (grid.ways("sample"), 1, *grid.spatial_shape))
        return dist, (grid.coord("sample"), 0, *grid.spatial_coords)

    def forward(self, x: DistTensor, ctx: Context) -> Any:
        """Predictions of the samples in :meth:`sample_range` (rows of the global batch)."""
        blocks = self.spatial.forward(x, ctx)
        self._range = self.to_samples.sample_range(x.dist, x.coord)
        self._batch = x.dist.global_shape[0]
        return self.head.forward(self.to_samples.forward(blocks, ctx), self._head_ctx(ctx))

    def backward(self, dy: Any, ctx: Context) -> None:
        dx = self.head.backward(dy, self._head_ctx(ctx))
        self.spatial.backward(self.to_samples.backward(dx, ctx), ctx)

    def sample_range(self) -> tuple[int, int]:
        """Global batch indices ``[a, b)`` of the rows :meth:`forward` returned."""
        return self._range

    def _head_ctx(self, ctx: Context) -> Context:
        """``ctx`` placing the head's local samples in the global batch (dropout masks)."""
        return replace(ctx, sample_offset=self._range[0], global_batch=self._batch)


def build_hybrid(model: Sequential, grid: ProcessGrid, input_shape: tuple[int, ...],
                 bn_statistics: str = "global", spatial_until: str = AUTO) -> HybridModel:
    """Cut ``model`` at its spatial stop and make each part's distributed twins."""
    index = spatial_stop(model, input_shape, grid.spatial_shape, spatial_until)
    bn_comm = grid.group_comms[BN_GROUPS[bn_statistics]]
    spatial = Sequential(name=model.name, needs_input_grad=False,
                         items=[spatial_twin(layer, grid, bn_comm)
                                for layer in model.items[:index]])
    head = Sequential(name=model.name, needs_input_grad=index > 0,
                      items=[sample_twin(layer, grid, bn_comm)
                             for layer in model.items[index:]])
    return HybridModel(spatial, ToSamples(name="to_samples", grid=grid,
                                          needs_input_grad=index > 0), head, grid)
