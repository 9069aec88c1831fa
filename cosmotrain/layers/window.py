"""What every sliding-window layer on spatial blocks shares: its halo buffers.

For an input distribution a rank computes, once, the layout of its halo buffer (halo
widths, exchange plan, extended block, zero padding on the global boundary: pure geometry
in ``tensor/halo_buffers.py``), the exchange and the output distribution.
``gather_halos`` returns the filled buffer the local kernel reads (``halo_buffer`` the
same before the exchange, for callers that overlap it); ``scatter_halo_grads`` completes
an input gradient computed on the extended block.

Memory: a layer that needs its input again in backward keeps the input block (alive
anyway: the previous layer holds it) and only the received margins (``save_margins``),
not the buffer, which would be a second copy of the block; ``restore_extended`` rebuilds
the extended block from the two without communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.comm.runtime import Runtime
from cosmotrain.device.xp import array_module
from cosmotrain.tensor.boxes import Box, box_empty, box_slices, to_local
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.halo import HaloExchange
from cosmotrain.tensor.halo_buffers import BufferLayout, Padding, buffer_layout


@dataclass(frozen=True)
class WindowGeometry(BufferLayout):
    """One rank's view of a window layer for one input distribution: the buffer layout,
    the exchange that fills the buffer and the output distribution."""

    exchange: HaloExchange
    out_dist: Distribution


def window_geometry(grid: ProcessGrid, x: DistTensor, kernel: Any, stride: Any,
                    padding: Padding, out_shape: tuple[int, ...],
                    runtime: Runtime | None = None) -> WindowGeometry:
    """Halo widths, exchange and output distribution of a window layer at ``x.coord``."""
    layout = buffer_layout(x.dist, x.coord, kernel, stride, padding)
    return WindowGeometry(layout.halos, layout.plans, HaloExchange(grid, layout.plans,
                                                                  runtime or Runtime()),
                          x.dist.with_shape(out_shape))


def halo_buffer(x: DistTensor, geo: WindowGeometry) -> Any:
    """The owned block in a buffer with zero margins, ready for the exchange.

    Zero, not garbage, so that a kernel may read the margins before the exchange fills
    them (the convolution computes a provisional shell meanwhile).  Only the margins are
    zeroed: ``np.zeros`` would clear the whole (reused, not fresh) heap block.  The
    buffer lives on the block's device.
    """
    xp = array_module(x.data)
    buffer = xp.empty(x.data.shape[:2] + geo.buffer_shape, dtype=x.data.dtype)
    buffer[box_slices(geo.own_box)] = x.data
    for slab in geo.margins():
        buffer[box_slices(slab)] = 0
    return buffer


def gather_halos(x: DistTensor, geo: WindowGeometry) -> Any:
    """The owned block in a buffer whose margins hold the neighbours' planes."""
    buffer = halo_buffer(x, geo)
    geo.exchange.exchange(buffer, "replace")
    return buffer


def save_margins(buffer: Any, geo: WindowGeometry) -> list[tuple[Box, Any]]:
    """Copies of the extended block's received planes, with their boxes (buffer coordinates).

    The extended block minus the owned block, as at most 6 slabs: small next to the block,
    which is why backward keeps these instead of the buffer.
    """
    return [(slab, buffer[box_slices(slab)].copy()) for slab in geo.received()]


def restore_extended(x: DistTensor, margins: list[tuple[Box, Any]], geo: WindowGeometry
                     ) -> Any:
    """The extended block rebuilt from the owned block and ``save_margins`` (no messages).

    Without margins it is a view of ``x.data`` (cropped by negative halos: the kernel
    makes the one copy it needs); otherwise one contiguous array the kernel reads as is.
    """
    owned = x.data[box_slices(geo.owned_in_block)]
    if not margins:
        return owned
    block = array_module(x.data).empty(geo.extended_shape(x.data.shape[:2]),
                                       dtype=x.data.dtype)
    for box, data in [(geo.owned_part, owned)] + margins:
        if not box_empty(box):
            block[box_slices(to_local(box, geo.extended_box))] = data
    return block


def scatter_halo_grads(grad_extended: Any, x: DistTensor, geo: WindowGeometry
                       ) -> tuple[Any, list]:
    """Place the extended block's gradient in a halo buffer and start sending its margins.

    When the extended block is the whole buffer (no cropped planes: the usual case) the
    gradient *is* the buffer, with no second block-sized array and no copy.  ``None``
    (a rank without output) gives a zero buffer.
    """
    shape = tuple(x.data.shape[:2]) + geo.buffer_shape
    if grad_extended is not None and tuple(grad_extended.shape) == shape:
        grad = grad_extended
    else:
        grad = array_module(x.data).zeros(shape, dtype=x.data.dtype)
        if grad_extended is not None:
            grad[geo.extended] = grad_extended
    return grad, geo.exchange.start(grad, "add")


def finish_halo_grads(grad: Any, pending: list, x: DistTensor, geo: WindowGeometry
                      ) -> DistTensor:
    """Add the neighbours' margin gradients into the owned planes; the input gradient.

    The gradient is a *view* of the owned planes of ``grad``: a copy would hold a second
    block-sized array at the backward peak.  The layers before a window layer accept
    strided gradients (activations work on them in place; kernels copy what they need).
    """
    geo.exchange.finish(grad, pending, "add")
    return DistTensor(grad[box_slices(geo.own_box)], x.dist, x.coord)


class SpatialWindow:
    """Mixin for window layers on spatial blocks: the cached per-distribution geometry.

    The layer provides ``grid``, ``runtime``, ``kernel``, ``stride``, ``padding``, ``output_shape`` and a
    ``_cache`` dict (dataclass fields of the concrete layer)."""

    def geometry(self, x: DistTensor) -> WindowGeometry:
        cache = self._cache  # type: ignore[attr-defined]
        if x.dist not in cache:
            cache[x.dist] = window_geometry(
                self.grid, x, self.kernel, self.stride, self.padding,  # type: ignore[attr-defined]
                self.output_shape(x.dist.global_shape),  # type: ignore[attr-defined]
                self.runtime)  # type: ignore[attr-defined]
        return cache[x.dist]
