"""What every sliding-window layer on spatial blocks shares: halo geometry and buffers.

For an input distribution a rank computes, once, its halo widths, its exchange plan, the
extended block and the zero padding on the global boundary (``tensor/windows.py``), and
the output distribution.  ``gather_halos`` returns the filled buffer the local kernel
reads; ``scatter_halo_grads`` completes an input gradient computed on the extended block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.halo import HaloExchange
from cosmotrain.tensor.windows import WindowHalo, halo_plans, spatial_halos

Padding = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


@dataclass
class WindowGeometry:
    """One rank's view of a window layer for one input distribution."""

    exchange: HaloExchange
    halos: tuple[WindowHalo, WindowHalo, WindowHalo]
    out_dist: Distribution

    @property
    def extended(self) -> tuple[Any, ...]:
        return (Ellipsis,) + tuple(p.extended for p in self.exchange.plans)

    @property
    def padding(self) -> Padding:
        return tuple((h.pad_lo, h.pad_hi) for h in self.halos)  # type: ignore[return-value]

    @property
    def has_output(self) -> bool:
        return all(h.out_range[1] > h.out_range[0] for h in self.halos)


def window_geometry(grid: ProcessGrid, x: DistTensor, kernel: Any, stride: Any,
                    padding: Padding, out_shape: tuple[int, ...]) -> WindowGeometry:
    """Halo widths, exchange and output distribution of a window layer at ``x.coord``."""
    halos = spatial_halos(x.dist, kernel, stride, padding)
    coords = x.coord[2:]
    plans = tuple(halo_plans(h)[c] for h, c in zip(halos, coords))
    mine = tuple(h[c] for h, c in zip(halos, coords))
    return WindowGeometry(HaloExchange(grid, plans), mine,  # type: ignore[arg-type]
                          x.dist.with_shape(out_shape))


def gather_halos(x: DistTensor, geo: WindowGeometry) -> Any:
    """The owned block in a buffer whose margins hold the neighbours' planes."""
    buffer = np.empty(x.data.shape[:2] + geo.exchange.buffer_shape, dtype=x.data.dtype)
    buffer[(Ellipsis,) + geo.exchange.own] = x.data
    geo.exchange.exchange(buffer, "replace")
    return buffer


def scatter_halo_grads(grad_extended: Any, buffer_shape: tuple[int, ...], dtype: Any,
                       geo: WindowGeometry) -> tuple[Any, list]:
    """Place the extended block's gradient in a buffer and start sending its margins."""
    grad = np.zeros(buffer_shape, dtype=dtype)
    if grad_extended is not None:
        grad[geo.extended] = grad_extended
    return grad, geo.exchange.start(grad, "add")


def finish_halo_grads(grad: Any, pending: list, x: DistTensor, geo: WindowGeometry
                      ) -> DistTensor:
    """Add the neighbours' margin gradients into the owned planes; the input gradient."""
    geo.exchange.finish(grad, pending, "add")
    owned = np.ascontiguousarray(grad[(Ellipsis,) + geo.exchange.own])
    return DistTensor(owned, x.dist, x.coord)


class SpatialWindow:
    """Mixin for window layers on spatial blocks: the cached per-distribution geometry.

    The layer provides ``grid``, ``kernel``, ``stride``, ``padding``, ``output_shape`` and a
    ``_cache`` dict (dataclass fields of the concrete layer)."""

    def geometry(self, x: DistTensor) -> WindowGeometry:
        cache = self._cache  # type: ignore[attr-defined]
        if x.dist not in cache:
            cache[x.dist] = window_geometry(
                self.grid, x, self.kernel, self.stride, self.padding,  # type: ignore[attr-defined]
                self.output_shape(x.dist.global_shape))  # type: ignore[attr-defined]
        return cache[x.dist]
