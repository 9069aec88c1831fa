"""Spatially partitioned pooling: the same halo geometry as the convolution.

Average pooling counts the zero padding of the global boundary (the kernel pads only
there); max pooling pads with -inf.  Forward keeps only the input (for its distribution)
and max pooling's argmax, not the halo buffer: backward needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.comm.runtime import Runtime
from cosmotrain.device.xp import array_module
from cosmotrain.kernels import pool3d
from cosmotrain.layers.window import (SpatialWindow, WindowGeometry, finish_halo_grads,
                                      gather_halos, scatter_halo_grads)
from cosmotrain.nn.layers import Pool3d
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor


@dataclass
class SpatialPool3d(SpatialWindow, Pool3d):
    """A :class:`Pool3d` whose input and output are :class:`DistTensor` blocks."""

    grid: ProcessGrid | None = None
    runtime: Runtime = field(default_factory=Runtime)  # the job's transport and timers
    _cache: dict = field(default_factory=dict, repr=False)


    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:  # type: ignore[override]
        geo = self.geometry(x)
        buffer = gather_halos(x, geo)
        extended = buffer[geo.extended]
        self._saved, self._argmax = x, None
        if not geo.has_output:
            y = array_module(x.data).zeros(geo.out_dist.local_shape(x.coord), x.data.dtype)
        elif self.mode == "avg":
            y = pool3d.avg_pool3d_forward(extended, self.kernel, self.stride, geo.padding)
        else:
            y, self._argmax = pool3d.max_pool3d_forward(extended, self.kernel, self.stride,
                                                        geo.padding)
        return DistTensor(y, geo.out_dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:  # type: ignore[override]
        x, self._saved = self._saved, None
        argmax, self._argmax = self._argmax, None
        if not self.needs_input_grad:
            return None
        geo = self.geometry(x)
        grad, pending = scatter_halo_grads(self._extended_grad(dy, argmax, x, geo), x, geo)
        return finish_halo_grads(grad, pending, x, geo)

    def _extended_grad(self, dy: DistTensor, argmax: Any, x: DistTensor,
                       geo: WindowGeometry) -> Any:
        if not geo.has_output:
            return None
        shape = geo.extended_shape(x.data.shape[:2])
        if self.mode == "avg":
            return pool3d.avg_pool3d_backward(dy.data, shape, self.kernel, self.stride,
                                              geo.padding)
        return pool3d.max_pool3d_backward(dy.data, argmax, shape, self.kernel, self.stride,
                                          geo.padding)


def spatial_pool(layer: Pool3d, grid: ProcessGrid, runtime: Runtime | None = None
                 ) -> SpatialPool3d:
    """The distributed twin of a :class:`Pool3d`."""
    return SpatialPool3d(name=layer.name, mode=layer.mode, kernel=layer.kernel,
                         stride=layer.stride, padding=layer.padding,
                         needs_input_grad=layer.needs_input_grad, grid=grid,
                         runtime=runtime or Runtime())
