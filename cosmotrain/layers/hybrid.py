"""A hybrid sample x spatial parallel model built from a single-process one.

The serial network's top-level layers are cut in two at the *spatial stop*: the layers
before it become their spatial twins (convolution and pooling with halos, block-wise
activations / batch norm / dropout) and run on :class:`DistTensor` blocks; a
:class:`ToSamples` all-to-all then hands whole samples to the rest of the network, which
runs data parallel.  Parameters are the serial model's own objects under the same names,
so initialisation, checkpoints and the optimizer do not know the difference.

Where to stop (``parallel.spatial_until``): ``auto`` stops at the first layer that cannot
run on blocks (flatten, global pooling, linear) or the first convolution or pooling
whose input block along a split dimension is thinner than :data:`MIN_BLOCK_PLANES` planes:
below that a k3 halo is half the block, exchanging it costs as much as computing it, and
whole samples are cheaper (``config.layout.thin_splits``: the one cheap rule on block
sizes, the config-time refusal uses it too).  A layer name stops there instead, held to
the exact halo rule (:func:`check_block_halos`); ``config.layout``'s docstring says, in
one place, how the cheap and the exact rule relate.  With no spatial split the whole
network is data parallel, unless channels are split (``parallel.channel`` /
``parallel.filter``): then the block part runs up to the first layer that cannot run on
blocks, its convolutions channel/filter parallel (``channel_conv.py``) and its other
layers on their fine channel blocks, and the head is data parallel over every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.config.layout import MIN_BLOCK_PLANES, thin_splits
from cosmotrain.config.schema import AUTO
from cosmotrain.errors import ConfigError
from cosmotrain.layers.batchnorm import channel_batchnorm, dist_batchnorm
from cosmotrain.layers.blockwise import blockwise
from cosmotrain.layers.channel_conv import channel_conv
from cosmotrain.layers.channel_plan import LayerChoice, plan_channels
from cosmotrain.layers.conv import spatial_conv
from cosmotrain.layers.shards import gather_full
from cosmotrain.layers.pool import spatial_pool
from cosmotrain.layers.to_samples import ToSamples
from cosmotrain.nn.containers import Residual, Sequential
from cosmotrain.nn.layers import BatchNorm3d, Conv3d, Dropout, LeakyReLU, Linear, Pool3d
from cosmotrain.nn.module import Context, Layer, Parameter, layer_path
from cosmotrain.tensor.channel_split import Factor, fine_block
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.windows import spatial_halos

# The ranks whose batch-norm sums are reduced, by ``parallel.bn_statistics``: in the block
# part (ranks holding the same channels) and in the head (every rank holds every channel).
BN_GROUPS = {"global": "data", "local": "spatial"}
HEAD_BN_GROUPS = {"global": "all", "local": "model"}


def runs_on_blocks(layer: Layer) -> bool:
    """Whether ``layer`` (and everything inside it) has a spatial twin."""
    if isinstance(layer, (Sequential, Residual)):
        return all(runs_on_blocks(child) for child in layer.children())
    return isinstance(layer, (Conv3d, Pool3d, BatchNorm3d, LeakyReLU, Dropout))


def spatial_stop(model: Sequential, input_shape: tuple[int, ...], ways: tuple[int, int, int],
                 until: str = AUTO, channel_ways: int = 1) -> int:
    """Index of the first top-level layer that runs on whole samples."""
    names = [layer.name for layer in model.items]
    if until != AUTO:
        index = _named_stop(model, names, until)
        check_block_halos(model.items[:index], input_shape, ways, until)
        return index
    if all(w == 1 for w in ways) and channel_ways == 1:
        return 0
    shape = input_shape
    for index, layer in enumerate(model.items):
        if not runs_on_blocks(layer) or (has_window(layer) and _thin(shape, ways)):
            return index
        shape = layer.output_shape(shape)
    return len(model.items)


def _thin(shape: tuple[int, ...], ways: tuple[int, int, int]) -> bool:
    """Whether a split dimension leaves blocks thinner than :data:`MIN_BLOCK_PLANES`."""
    return bool(thin_splits(shape[2:], ways, MIN_BLOCK_PLANES))


def has_window(layer: Layer) -> bool:
    """Whether ``layer`` contains a convolution or pooling (a layer with halos)."""
    return any(isinstance(sub, (Conv3d, Pool3d)) for sub in layer.layers())


def check_block_halos(items: list[Layer], input_shape: tuple[int, ...],
                      ways: tuple[int, int, int], until: str) -> None:
    """Refuse a named stop whose block part holds a convolution or pooling the halo
    exchange cannot serve: the engine's own rule (``tensor.windows.check_halos``, through
    ``spatial_halos``), met here when the model is built instead of at the first step."""
    shape = input_shape
    for top in items:
        for path, layer, in_shape in _windows(top, shape, ""):
            try:
                spatial_halos(Distribution(in_shape, (1, 1) + tuple(ways)), layer.kernel,
                              layer.stride, layer.padding)
            except ValueError as err:
                reason = str(err).split(";")[0]
                raise ConfigError("parallel.spatial_until", f"{until!r} keeps layer {path!r} "
                                  f"on spatial blocks too thin for its halo ({reason})",
                                  f"stop at or before {top.name!r}, use auto, or split the "
                                  f"spatial dimensions fewer ways") from None
        shape = top.output_shape(shape)


def _windows(layer: Layer, shape: tuple[int, ...], prefix: str
             ) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    """``(dotted name, layer, input shape)`` of every convolution and pooling in ``layer``."""
    path = layer_path(prefix, layer.name)
    if isinstance(layer, (Conv3d, Pool3d)):
        yield path, layer, shape
    elif isinstance(layer, Sequential):
        inner = f"{path}." if path else ""
        for child in layer.items:
            yield from _windows(child, shape, inner)
            shape = child.output_shape(shape)
    elif isinstance(layer, Residual):
        inner = f"{path}." if path else ""
        yield from _windows(layer.body, shape, inner)
        if layer.shortcut is not None:
            yield from _windows(layer.shortcut, shape, inner)


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


@dataclass
class BlockTwins:
    """Makes the twins of the block part: spatial, and channel/filter parallel when the
    grid splits channels (``choices``: each convolution's algorithm, by dotted name)."""

    grid: ProcessGrid
    runtime: Runtime
    bn_comm: Any
    choices: Mapping[str, LayerChoice] = field(default_factory=dict)

    @property
    def group(self) -> Any:
        return self.grid.group_comms["channel_filter"]

    def twin(self, layer: Layer, prefix: str = "") -> Layer:
        """The layer's twin on blocks; parameters shared, or my block of them."""
        path = layer_path(prefix, layer.name)
        split = self.group.Get_size() > 1
        if isinstance(layer, Conv3d):
            return channel_conv(layer, self.grid, self.choices[path], self.runtime) if split \
                else spatial_conv(layer, self.grid, self.runtime)
        if isinstance(layer, Pool3d):
            return spatial_pool(layer, self.grid, self.runtime)
        if isinstance(layer, BatchNorm3d) and split:
            channels = fine_block(layer.channels, self.group.Get_size(), self.group.Get_rank())
            return channel_batchnorm(layer, self.bn_comm, self.runtime.timers, channels,
                                     self.runtime.transport)
        if isinstance(layer, BatchNorm3d):
            return dist_batchnorm(layer, self.bn_comm, self.runtime.timers, spatial=True,
                                  transport=self.runtime.transport)
        if isinstance(layer, (LeakyReLU, Dropout)):
            return blockwise(layer)
        inner = f"{path}." if path else ""
        return _map_children(layer, lambda child: self.twin(child, inner))


def sample_twin(layer: Layer, bn_comm: Any, runtime: Runtime) -> Layer:
    """The layer for whole local samples: batch norm reduces its sums, convolutions and
    linear layers run under the runtime's GPU kernel settings, the rest is serial."""
    if isinstance(layer, BatchNorm3d):
        return dist_batchnorm(layer, bn_comm, runtime.timers, spatial=False,
                              transport=runtime.transport)
    if isinstance(layer, (Sequential, Residual)):
        return _map_children(layer, lambda child: sample_twin(child, bn_comm, runtime))
    if isinstance(layer, (Conv3d, Linear)) and layer.conv_settings != runtime.conv:
        return replace(layer, conv_settings=runtime.conv)  # same parameters and buffers
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
    runtime: Runtime = field(default_factory=Runtime)  # the job's transport and timers

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """This rank's parameters: blocks of the split layers' (``param.shard``), the rest."""
        yield from self.spatial.named_parameters()
        yield from self.head.named_parameters()

    def named_buffers(self) -> Iterator[tuple[str, Layer, str]]:
        yield from self.spatial.named_buffers()
        yield from self.head.named_buffers()

    def reduction_groups(self) -> list[tuple[Any, list[Parameter]]]:
        """``(communicator, parameters)`` over which each parameter's gradient is summed.

        A block of a split layer is summed over the ranks holding the same block (the
        data group); a whole parameter over every rank.  Without a channel split the two
        groups are the same ranks, and one group keeps the buckets as they were.
        """
        comms = self.grid.group_comms
        if comms["channel_filter"].Get_size() == 1:
            return [(comms["data"], [p for _, p in self.named_parameters()])]
        return [(comms["data"], [p for _, p in self.spatial.named_parameters()]),
                (comms["all"], [p for _, p in self.head.named_parameters()])]

    def full_parameters(self, root: int | None = None) -> dict[str, Any] | None:
        """Every parameter as the full array (collective over the channel/filter group;
        on its rank ``root`` only when given, see :func:`gather_full`)."""
        items = [(name, p.data, p.shard) for name, p in self.named_parameters()]
        return gather_full(self.grid.group_comms["channel_filter"], items, root)

    def full_buffers(self, root: int | None = None) -> dict[str, Any] | None:
        """Every buffer (batch-norm running statistics) as the full array (collective)."""
        items = [(name, layer.buffers[key], _buffer_shard(layer, key))
                 for name, layer, key in self.named_buffers()]
        return gather_full(self.grid.group_comms["channel_filter"], items, root)

    @property
    def stop(self) -> str:
        """Name of the first layer on whole samples ('' when every layer is spatial)."""
        return self.head.items[0].name if self.head.items else ""

    def input_distribution(self, input_shape: tuple[int, ...]) -> tuple[Distribution,
                                                                       tuple[int, ...]]:
        """How a mini-batch of ``input_shape`` (N, C, D, H, W) is cut, and my block."""
        grid = self.grid
        group = grid.group_comms["channel_filter"]
        dist = Distribution(input_shape, (grid.ways("sample"), group.Get_size(),
                                          *grid.spatial_shape))
        return dist, (grid.coord("sample"), group.Get_rank(), *grid.spatial_coords)

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


def _buffer_shard(layer: Layer, key: str) -> Any:
    """The shard of a per-channel buffer of a channel-split layer (None: not split)."""
    return getattr(layer, "shard", None) if np.ndim(layer.buffers[key]) else None


def build_hybrid(model: Sequential, grid: ProcessGrid, input_shape: tuple[int, ...],
                 bn_statistics: str = "global", *, runtime: Runtime) -> HybridModel:
    """Cut ``model`` at its spatial stop and make each part's distributed twins, which
    take the transport, the timers and the GPU kernel settings (``runtime.conv``, for
    the convolutions and linear layers) from the job's ``runtime``.

    Where spatial parallelism stops, the channel/filter algorithm and the per-layer
    overrides are the grid's layout's (``grid.layout``): one value, not repeated here."""
    layout = grid.layout
    group = grid.group_comms["channel_filter"].Get_size()
    index = spatial_stop(model, input_shape, grid.spatial_shape, layout.spatial_until, group)
    choices = plan_channels(model.items[:index], input_shape,
                            Factor(grid.ways("channel"), grid.ways("filter")),
                            grid.spatial_shape, grid.ways("sample"), layout.channel_algorithm,
                            layout.layer_overrides) if group > 1 else {}
    if group == 1 and layout.layers:
        raise ConfigError("parallel.layers", "per-layer channel/filter settings need "
                          "parallel.channel or parallel.filter above 1", "remove them")
    twins = BlockTwins(grid, runtime, grid.group_comms[BN_GROUPS[bn_statistics]], choices)
    spatial = Sequential(name=model.name, needs_input_grad=False,
                         items=[twins.twin(layer) for layer in model.items[:index]])
    head_bn = grid.group_comms[HEAD_BN_GROUPS[bn_statistics]]
    head = Sequential(name=model.name, needs_input_grad=index > 0,
                      items=[sample_twin(layer, head_bn, runtime)
                             for layer in model.items[index:]])
    return HybridModel(spatial, ToSamples(name="to_samples", grid=grid, runtime=runtime,
                                          needs_input_grad=index > 0), head, grid, runtime)
