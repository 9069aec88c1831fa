"""Channel/filter parallel convolution (stationary-x, -y, -w), on spatial blocks.

Forward: all-gather the input's fine channel blocks over the ranks sharing my channel
block (``filter_comm``: nothing moves under stationary-x), convolve my weight block
``w[F_if, C_ic]`` with halos exactly like :class:`SpatialConv3d` (the inner layer), and
reduce-scatter the partial outputs over the ranks sharing my filter block
(``channel_comm``: nothing moves under stationary-y), which leaves my fine block of the
output channels.  Backward is the adjoint: all-gather ``dL/dy`` over ``channel_comm``,
the inner backward (weight gradient local, halo gradients to the spatial neighbours),
reduce-scatter ``dL/dx`` over ``filter_comm``.  See ``tensor/channel_split.py`` for the blocks.

The weight gradient is this rank's partial sum over its samples and spatial block; the
gradient reducer sums it over the ranks holding the same block, and only those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cpu.channel_sums import channel_sums
from cosmotrain.layers.channel_plan import LayerChoice
from cosmotrain.layers.conv import SpatialConv3d
from cosmotrain.layers.shards import Shard
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Context, Parameter
from cosmotrain.tensor.channel_collectives import allgather_channels, reduce_scatter_channels
from cosmotrain.tensor.channel_split import ChannelBlocks
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import unsplit


@dataclass
class ChannelConv3d(Conv3d):
    """A :class:`Conv3d` whose weights, inputs and outputs are split by channel/filter."""

    grid: ProcessGrid | None = None
    runtime: Runtime = field(default_factory=Runtime)  # the job's transport and timers
    algorithm: str = "x"
    blocks: ChannelBlocks | None = None
    channel_comm: Any = None  # the ranks sharing my filter block: reduce-scatter of y
    filter_comm: Any = None  # the ranks sharing my channel block: all-gather of x
    inner: SpatialConv3d | None = None  # None when my weight block is empty
    # Accounting: elements this rank moved (received in all-gathers, sent in
    # reduce-scatters) and its last input / output elements per channel.
    volume: dict = field(default_factory=lambda: {"allgather": 0, "reduce_scatter": 0})
    elements_per_channel: tuple[int, int] = (0, 0)

    def take_activation(self, slope: float | None) -> bool:
        """Never: the inner convolution's outputs are partial sums (reduce-scattered)."""
        return False

    def take_activation_grad(self, y: Any, slope: float) -> bool:
        """Never: its output gradient is all-gathered first (no kernel sees it whole)."""
        return False

    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:  # type: ignore[override]
        out_dist = x.dist.with_shape(self.output_shape(x.dist.global_shape))
        gathered = self._allgather(self.filter_comm, x.data, self.blocks.input_pieces())
        local = DistTensor(gathered, *unsplit(x.dist, x.coord, 1, gathered.shape[1])) \
            if self.inner is not None else None
        self._saved = (x.dist, x.coord, local)
        if local is None:
            shape = (x.data.shape[0], len(self.blocks.filter_rows()))
            partial = array_module(x.data).zeros(shape + out_dist.local_shape(x.coord)[2:],
                                                 x.data.dtype)
        else:
            self.inner.needs_input_grad = self.needs_input_grad
            partial = self.inner.forward(local, ctx).data
        y = self._reduce_scatter(self.channel_comm, partial, self.blocks.output_pieces())
        if self.bias:
            y += self.params["bias"].like(y).reshape(1, -1, 1, 1, 1)
        self.elements_per_channel = (_per_channel(x.data), _per_channel(y))
        return DistTensor(y, out_dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:  # type: ignore[override]
        dist, coord, local = self._saved
        self._saved = None
        if self.bias:
            self.params["bias"].accumulate(channel_sums(dy.data))
        dy_all = self._allgather(self.channel_comm, dy.data, self.blocks.output_pieces())
        xp = array_module(dy.data)
        if local is None:
            weight = self.params["weight"]
            weight.accumulate(xp.zeros(weight.shape, weight.data.dtype))
            dx = None if not self.needs_input_grad else xp.zeros(
                (dy.data.shape[0], sum(self.blocks.input_pieces())) +
                dist.local_shape(coord)[2:], dy.data.dtype)
        else:
            out = local.dist.with_shape(self.inner.output_shape(local.dist.global_shape))
            grad = self.inner.backward(DistTensor(dy_all, out, local.coord), ctx)
            dx = None if grad is None else grad.data
        if dx is None:
            return None
        dx = self._reduce_scatter(self.filter_comm, dx, self.blocks.input_pieces())
        return DistTensor(dx, dist, coord)

    def _allgather(self, comm: Any, block: Any, pieces: list[int]) -> Any:
        with self.runtime.timers.phase("channel"):
            out = allgather_channels(comm, block, pieces,
                                     self.runtime.transport)
        self.volume["allgather"] += out.size - block.size
        return out

    def _reduce_scatter(self, comm: Any, partial: Any, pieces: list[int]) -> Any:
        with self.runtime.timers.phase("channel"):
            out = reduce_scatter_channels(comm, partial, pieces,
                                          self.runtime.transport)
        self.volume["reduce_scatter"] += partial.size - out.size
        return out


def _per_channel(block: Any) -> int:
    return int(block.shape[0] * np.prod(block.shape[2:]))


def channel_conv(layer: Conv3d, grid: ProcessGrid, choice: LayerChoice,
                 runtime: Runtime | None = None) -> ChannelConv3d:
    """The channel/filter twin of ``layer``: my weight block, my comms, an inner conv."""
    runtime = runtime or Runtime()
    rank = grid.group_comms["channel_filter"].Get_rank()
    blocks = ChannelBlocks(layer.in_channels, layer.out_channels, choice.factor, rank)
    channel_comm, filter_comm = grid.channel_filter_comms(choice.factor)
    weight = layer.params["weight"].data
    shard = Shard(weight.shape, blocks.weight_index())
    params = {"weight": Parameter(shard.take(weight), shard)}
    if layer.bias:
        bias_shard = Shard((layer.out_channels,), (slice(*blocks.output_block()),))
        params["bias"] = Parameter(bias_shard.take(layer.params["bias"].data), bias_shard)
    rows, (lo, hi) = len(blocks.filter_rows()), blocks.input_channels()
    inner = None
    if rows and hi > lo:
        inner = SpatialConv3d(name=layer.name, params={"weight": params["weight"]},
                              in_channels=hi - lo, out_channels=rows, kernel=layer.kernel,
                              stride=layer.stride, padding=layer.padding, bias=False,
                              needs_input_grad=layer.needs_input_grad, grid=grid,
                              conv_settings=runtime.conv, runtime=runtime)
    return ChannelConv3d(name=layer.name, params=params, in_channels=layer.in_channels,
                         out_channels=layer.out_channels, kernel=layer.kernel,
                         stride=layer.stride, padding=layer.padding, bias=layer.bias,
                         needs_input_grad=layer.needs_input_grad, grid=grid,
                         conv_settings=runtime.conv, runtime=runtime, algorithm=choice.algorithm,
                         blocks=blocks, channel_comm=channel_comm, filter_comm=filter_comm,
                         inner=inner)
