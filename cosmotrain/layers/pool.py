"""Spatially partitioned pooling: the same halo geometry as the convolution.

Average pooling counts the zero padding of the global boundary (the kernel pads only
there); max pooling pads with -inf.  Forward keeps only the input (for its distribution)
and max pooling's argmax, not the halo buffer: backward needs nothing else.

Memory: forward receives the neighbours' planes without a halo buffer
(``receive_margins``) and, when the extended block is large, pools it a slab of planes
at a time (``SLAB_BYTES``), each slab rebuilt from the owned block and the margins: the
buffer was a copy of the block beside the block itself (the previous activation, which
its layer keeps for backward), the largest array of the forward.  The results are those
of one call on the whole extended block (:func:`~cosmotrain.kernels.pool3d.pools_by_planes`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.device.xp import array_module
from cosmotrain.kernels import pool3d
from cosmotrain.layers.windowed import (SpatialWindow, WindowGeometry, finish_halo_grads,
                                         receive_margins, restore_extended, scatter_halo_grads)
from cosmotrain.nn.layers import Pool3d
from cosmotrain.nn.module import Context, Layer
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.windows import plane_runs

# Input bytes pooled per call when the extended block is pooled in slabs: small next to
# a block (pool1 of W=256 on 4 ranks reads 260 MiB), large enough that the calls' fixed
# costs stay small (7 planes there).  All slabs of a forward share one buffer: a fresh
# array per slab (17 of 15 MiB per step there) moved glibc's dynamic mmap threshold and
# left the D2H2 step's peak 27 MiB higher in half the runs (none of 6 with one buffer).
# Under the job's heap-only allocator (``device.reuse_freed_memory``) slabs of one
# output plane left 178 MiB more fragmentation than slabs of 8 to 32 MiB (dev-2core).
SLAB_BYTES = 16 << 20

Margins = list[tuple[Any, Any]]


@dataclass
class SpatialPool3d(SpatialWindow, Pool3d):
    """A :class:`Pool3d` whose input and output are :class:`DistTensor` blocks."""

    grid: ProcessGrid | None = None
    runtime: Runtime = field(default_factory=Runtime)  # the job's transport and timers
    _cache: dict = field(default_factory=dict, repr=False)

    def take_preceding_activation(self, before: Sequence[Layer]) -> None:
        """Never: the activation's backward follows the halo gradients' sums."""

    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:  # type: ignore[override]
        geo = self.geometry(x)
        margins = receive_margins(x, geo)
        self._saved, self._argmax = x, None
        if not geo.has_output:
            y = array_module(x.data).zeros(geo.out_dist.local_shape(x.coord), x.data.dtype)
        else:
            y, self._argmax = self._pooled(x, margins, geo)
        return DistTensor(y, geo.out_dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:  # type: ignore[override]
        x, self._saved = self._saved, None
        argmax, self._argmax = self._argmax, None
        if not self.needs_input_grad:
            return None
        geo = self.geometry(x)
        grad, pending = scatter_halo_grads(self._extended_grad(dy, argmax, x, geo), x, geo)
        return finish_halo_grads(grad, pending, x, geo)

    def _pooled(self, x: DistTensor, margins: Margins, geo: WindowGeometry
                ) -> tuple[Any, Any]:
        """The output block and max pooling's argmax (None for average pooling): one
        kernel call on the extended block, or one per slab of planes (see module doc)."""
        runs = self._runs(x, geo) if margins else []
        if len(runs) <= 1:
            return self._pool(restore_extended(x, margins, geo), geo.padding, False)
        xp = array_module(x.data)
        shape = geo.out_dist.local_shape(x.coord)
        y, argmax = xp.empty(shape, x.data.dtype), None
        for (o0, o1), planes, pads, slab in _with_slabs(x, geo, runs):
            part, arg = self._pool(restore_extended(x, margins, geo, planes, slab),
                                   (pads,) + geo.padding[1:], True)
            y[:, :, o0:o1] = part
            if arg is not None:
                argmax = xp.empty(shape, arg.dtype) if argmax is None else argmax
                argmax[:, :, o0:o1] = arg
        return y, argmax

    def _runs(self, x: DistTensor, geo: WindowGeometry) -> list:
        """The output planes' runs of about ``SLAB_BYTES`` of input each, or none when the
        kernels would not pool the extended block plane by plane (small blocks, GPUs)."""
        extended = geo.extended_shape(x.data.shape[:2])
        if not pool3d.pools_by_planes(extended, x.data):
            return []
        plane = math.prod(extended) // extended[2] * x.data.itemsize
        halo = geo.halos[0]
        runs = plane_runs(halo.out_range[1] - halo.out_range[0], extended[2], self.kernel[0],
                          self.stride[0], halo.pad_lo, SLAB_BYTES // plane)
        return [] if any(lo == hi for _, (lo, hi), _ in runs) else runs

    def _pool(self, extended: Any, padding: Any, by_planes: bool) -> tuple[Any, Any]:
        if self.mode == "avg":
            return pool3d.avg_pool3d_forward(extended, self.kernel, self.stride, padding,
                                             by_planes=by_planes), None
        return pool3d.max_pool3d_forward(extended, self.kernel, self.stride, padding,
                                         by_planes=by_planes)

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


def _with_slabs(x: DistTensor, geo: WindowGeometry, runs: list) -> Iterator[tuple]:
    """Each run with its slab: a view (N, C, planes, H, W) of one buffer that every slab
    shares, so a forward allocates once (see ``SLAB_BYTES``)."""
    n, c = x.data.shape[:2]
    _, h, w = geo.extended_shape(())
    planes = max(hi - lo for _, (lo, hi), _ in runs)
    buffer = array_module(x.data).empty(n * c * planes * h * w, x.data.dtype)
    for out, (lo, hi), pads in runs:
        yield out, (lo, hi), pads, buffer[:n * c * (hi - lo) * h * w].reshape(n, c, hi - lo, h, w)


def spatial_pool(layer: Pool3d, grid: ProcessGrid, runtime: Runtime | None = None
                 ) -> SpatialPool3d:
    """The distributed twin of a :class:`Pool3d`."""
    return SpatialPool3d(name=layer.name, mode=layer.mode, kernel=layer.kernel,
                         stride=layer.stride, padding=layer.padding,
                         needs_input_grad=layer.needs_input_grad, grid=grid,
                         runtime=runtime or Runtime())
