"""Spatially partitioned 3D convolution (the Distconv algorithm).

Forward: the owned block goes into a buffer with margins, the halo exchange fills them,
and the ordinary kernel runs on the rank's *extended block* with zero padding only on the
global boundary, producing exactly the rank's block of the output (every tensor uses the
same balanced split, see ``tensor/windows.py``).  Backward: the data gradient of the
extended block is computed, its margins start travelling back (add mode), and the weight
gradient is computed while they travel; then the received margin gradients are added into
the owned planes.  The weight gradient is this rank's partial sum: the trainer reduces it
over the ranks that share the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.kernels import conv3d
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.halo import HaloExchange
from cosmotrain.tensor.windows import WindowHalo, halo_plans, spatial_halos


@dataclass
class _Geometry:
    """Everything a rank needs for one input distribution (computed once, cached)."""

    exchange: HaloExchange
    halos: tuple[WindowHalo, WindowHalo, WindowHalo]
    out_dist: Any

    @property
    def extended(self) -> tuple[slice, slice, slice]:
        return tuple(p.extended for p in self.exchange.plans)  # type: ignore[return-value]

    @property
    def padding(self) -> tuple[tuple[int, int], ...]:
        return tuple((h.pad_lo, h.pad_hi) for h in self.halos)

    @property
    def has_output(self) -> bool:
        return all(h.out_range[1] > h.out_range[0] for h in self.halos)


@dataclass
class SpatialConv3d(Conv3d):
    """A :class:`Conv3d` whose input and output are :class:`DistTensor` blocks."""

    grid: ProcessGrid | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def geometry(self, x: DistTensor) -> _Geometry:
        if x.dist not in self._cache:
            halos = spatial_halos(x.dist, self.kernel, self.stride, self.padding)
            coords = x.coord[2:]
            plans = tuple(halo_plans(h)[c] for h, c in zip(halos, coords))
            mine = tuple(h[c] for h, c in zip(halos, coords))
            out_shape = self.output_shape(x.dist.global_shape)
            self._cache[x.dist] = _Geometry(HaloExchange(self.grid, plans), mine,
                                            x.dist.with_shape(out_shape))
        return self._cache[x.dist]

    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:  # type: ignore[override]
        geo = self.geometry(x)
        buffer = np.empty(x.data.shape[:2] + geo.exchange.buffer_shape, dtype=x.data.dtype)
        buffer[(...,) + geo.exchange.own] = x.data
        geo.exchange.exchange(buffer, "replace")
        self._saved = (buffer, x)
        out_local = geo.out_dist.local_shape(x.coord)
        if geo.has_output:
            y = conv3d.conv3d_forward(buffer[(...,) + geo.extended],
                                      self.params["weight"].data, self.stride, geo.padding)
            if self.bias:
                y += self.params["bias"].data.reshape(1, -1, 1, 1, 1)
        else:
            y = np.zeros(out_local, dtype=x.data.dtype)
        return DistTensor(y, geo.out_dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:  # type: ignore[override]
        (buffer, x), self._saved = self._saved, None
        geo = self.geometry(x)
        weight = self.params["weight"]
        grad = np.zeros_like(buffer) if self.needs_input_grad else None
        pending = None
        if grad is not None and geo.has_output:
            grad[(...,) + geo.extended] = conv3d.conv3d_backward_data(
                dy.data, weight.data, grad[(...,) + geo.extended].shape, self.stride,
                geo.padding)
        if grad is not None:
            pending = geo.exchange.start(grad, "add")  # margins travel while wgrad runs
        weight.accumulate(self._weight_grad(buffer, dy, geo))
        if self.bias:
            self.params["bias"].accumulate(dy.data.sum(axis=(0, 2, 3, 4)))
        if grad is None:
            return None
        geo.exchange.finish(grad, pending, "add")
        return DistTensor(np.ascontiguousarray(grad[(...,) + geo.exchange.own]), x.dist,
                          x.coord)

    def _weight_grad(self, buffer: Any, dy: DistTensor, geo: _Geometry) -> Any:
        shape = self.params["weight"].shape
        if not geo.has_output:
            return np.zeros(shape, dtype=buffer.dtype)
        return conv3d.conv3d_backward_filter(buffer[(...,) + geo.extended], dy.data, shape,
                                             self.stride, geo.padding)


def spatial_conv(layer: Conv3d, grid: ProcessGrid) -> SpatialConv3d:
    """The distributed twin of a :class:`Conv3d`, sharing its parameters."""
    return SpatialConv3d(name=layer.name, params=layer.params, in_channels=layer.in_channels,
                         out_channels=layer.out_channels, kernel=layer.kernel,
                         stride=layer.stride, padding=layer.padding, bias=layer.bias,
                         needs_input_grad=layer.needs_input_grad, grid=grid)
