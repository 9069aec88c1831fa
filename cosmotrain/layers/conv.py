"""Spatially partitioned 3D convolution (the Distconv algorithm).

Forward: the halo exchange fills the margins of the owned block, and the ordinary kernel
runs on the rank's *extended block* with zero padding only on the global boundary,
producing exactly the rank's block of the output (every tensor uses the same balanced
split, see ``tensor/windows.py``).  Backward: the data gradient of the extended block is
computed, its margins start travelling back (add mode), and the weight gradient is
computed while they travel; then the received margin gradients are added into the owned
planes.  The weight gradient is this rank's partial sum: the trainer reduces it over the
ranks that share the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.kernels import conv3d
from cosmotrain.layers.window import (SpatialWindow, WindowGeometry, finish_halo_grads,
                                      gather_halos, scatter_halo_grads)
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor


@dataclass
class SpatialConv3d(SpatialWindow, Conv3d):
    """A :class:`Conv3d` whose input and output are :class:`DistTensor` blocks."""

    grid: ProcessGrid | None = None
    _cache: dict = field(default_factory=dict, repr=False)


    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:  # type: ignore[override]
        geo = self.geometry(x)
        buffer = gather_halos(x, geo)
        self._saved = (buffer, x)
        if not geo.has_output:
            return DistTensor(np.zeros(geo.out_dist.local_shape(x.coord), x.data.dtype),
                              geo.out_dist, x.coord)
        y = conv3d.conv3d_forward(buffer[geo.extended], self.params["weight"].data,
                                  self.stride, geo.padding)
        if self.bias:
            y += self.params["bias"].data.reshape(1, -1, 1, 1, 1)
        return DistTensor(y, geo.out_dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:  # type: ignore[override]
        (buffer, x), self._saved = self._saved, None
        geo = self.geometry(x)
        weight = self.params["weight"]
        pending = None
        if self.needs_input_grad:
            dext = None
            if geo.has_output:
                dext = conv3d.conv3d_backward_data(dy.data, weight.data,
                                                   buffer[geo.extended].shape, self.stride,
                                                   geo.padding)
            grad, pending = scatter_halo_grads(dext, buffer.shape, buffer.dtype,
                                               geo)  # margins travel ...
        weight.accumulate(self._weight_grad(buffer, dy, geo))  # ... while wgrad runs
        if self.bias:
            self.params["bias"].accumulate(dy.data.sum(axis=(0, 2, 3, 4)))
        if pending is None:
            return None
        return finish_halo_grads(grad, pending, x, geo)

    def _weight_grad(self, buffer: Any, dy: DistTensor, geo: WindowGeometry) -> Any:
        shape = self.params["weight"].shape
        if not geo.has_output:
            return np.zeros(shape, dtype=buffer.dtype)
        return conv3d.conv3d_backward_filter(buffer[geo.extended], dy.data, shape,
                                             self.stride, geo.padding)


def spatial_conv(layer: Conv3d, grid: ProcessGrid) -> SpatialConv3d:
    """The distributed twin of a :class:`Conv3d`, sharing its parameters."""
    return SpatialConv3d(name=layer.name, params=layer.params, in_channels=layer.in_channels,
                         out_channels=layer.out_channels, kernel=layer.kernel,
                         stride=layer.stride, padding=layer.padding, bias=layer.bias,
                         needs_input_grad=layer.needs_input_grad, grid=grid)
