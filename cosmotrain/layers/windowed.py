"""What every sliding-window layer on spatial blocks shares: its halo buffers.

For an input distribution a rank computes, once, the layout of its halo buffer (halo
widths, exchange plan, extended block, zero padding on the global boundary: pure geometry
in ``tensor/halo_buffers.py``), the exchange and the output distribution.
``halo_buffer`` is the buffer the convolution's exchange fills while its interior is
computed; ``scatter_halo_grads`` completes an input gradient computed on the extended
block.

Memory: a layer that needs its input again in backward keeps the input block (alive
anyway: the previous layer holds it) and only the received margins (``save_margins``),
not the buffer, which would be a second copy of the block; ``restore_extended`` rebuilds
the extended block, or a slab of its planes, from the two without communication.  A
layer that reads the margins once (pooling) receives them without any buffer
(``receive_margins``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.device.xp import array_module, is_device_array
from cosmotrain.tensor.boxes import (Box, Range, box_empty, box_shape, box_slices, intersect,
                                     to_local)
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


def receive_margins(x: DistTensor, geo: WindowGeometry) -> list[tuple[Box, Any]]:
    """The neighbours' planes of the buffer, each with its box (buffer coordinates),
    exchanged without a buffer: what ``restore_extended`` needs besides the block."""
    return [(tuple((r.start, r.stop) for r in region), planes)
            for region, planes in geo.exchange.gather_margins(x.data)]


def save_margins(buffer: Any, geo: WindowGeometry) -> list[tuple[Box, Any]]:
    """Copies of the extended block's received planes, with their boxes (buffer coordinates).

    The extended block minus the owned block, as at most 6 slabs: small next to the block,
    which is why backward keeps these instead of the buffer.
    """
    return [(slab, buffer[box_slices(slab)].copy()) for slab in geo.received()]


def restore_extended(x: DistTensor, margins: list[tuple[Box, Any]], geo: WindowGeometry,
                     planes: Range | None = None, out: Any = None) -> Any:
    """The extended block, or its ``planes`` along D (extended-block indices), rebuilt
    from the owned block and received margins (``save_margins``, ``receive_margins``;
    no messages).

    When it holds owned planes only, it is a view of ``x.data`` (cropped by negative
    halos: the kernel makes the one copy it needs); otherwise one contiguous array the
    kernel reads as is: ``out`` when given (contiguous, of that shape), else a new one.
    """
    target = geo.extended_box
    if planes is not None:
        start = target[0][0]
        target = ((start + planes[0], start + planes[1]),) + target[1:]
    owned = intersect(target, geo.own_box)
    if owned == target:
        return x.data[box_slices(to_local(owned, geo.own_box))]
    block = out if out is not None else array_module(x.data).empty(
        x.data.shape[:2] + box_shape(target), dtype=x.data.dtype)
    for box, data in [(geo.own_box, x.data)] + margins:
        common = intersect(box, target)
        if not box_empty(common):
            block[box_slices(to_local(common, target))] = data[box_slices(to_local(common, box))]
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

    The gradient lives in ``grad``'s memory: a copy would hold a second block-sized
    array at the backward peak.  On the host its planes are moved to the front of the
    buffer (:func:`compact_owned`), so it is contiguous: the convolution kernels copy a
    strided gradient to a contiguous one, block-sized again, in the data and in the
    weight gradient of the layer before (on 3 of the 4 ranks of a W=256 D2H2 step, the
    step's peak).  On a GPU it stays a view (see :func:`compact_owned`).
    """
    geo.exchange.finish(grad, pending, "add")
    return DistTensor(compact_owned(grad, geo.own_box), x.dist, x.coord)


def compact_owned(buffer: Any, box: Box) -> Any:
    """``buffer[box]`` as a C-contiguous array in the first elements of ``buffer``'s own
    memory (whose other contents are lost); a view of ``buffer`` where that cannot be.

    One (H, W) plane after another in C order: plane ``i`` goes to elements ``[i*P,
    (i+1)*P)`` (``P`` its size) and comes from elements at ``i*P`` or beyond, so a
    plane never overwrites one still to be moved; a plane overlapping its own target is
    copied through a temporary by numpy.  Device arrays keep the view: cupy copies
    overlapping memory with no defined order.
    """
    view = buffer[box_slices(box)]
    if view.flags.c_contiguous or is_device_array(buffer) or not buffer.flags.c_contiguous:
        return view
    out = buffer.reshape(-1)[:view.size].reshape(view.shape)
    for index in np.ndindex(*view.shape[:-2]):
        out[index] = view[index]
    return out


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
