"""Spatially partitioned 3D convolution (the Distconv algorithm).

Forward: the halo exchange fills the margins of the owned block, and the ordinary kernel
runs on the rank's *extended block* with zero padding only on the global boundary,
producing exactly the rank's block of the output (every tensor uses the same balanced
split, see ``tensor/windows.py``).  The exchange overlaps compute: once the messages are
posted, the *interior* of the output (windows that read no margin plane) is computed;
then the exchange completes and the thin boundary shell follows, in at most 6 calls
(``tensor/interior.py``).  When the shell is thin the first call covers the whole output
and the shell is recomputed (see ``REDO_SHELL_MAX``).  A rank with nothing to receive
computes everything in one call while its sends travel; one whose interior is empty
waits, then makes one call.

Backward: the data gradient of the extended block is computed, its margins start
travelling back (add mode), and the weight gradient is computed while they travel; then
the received margin gradients are added into the owned planes.  The weight gradient is
this rank's partial sum: the trainer reduces it over the ranks that share the weights.

Kernel settings: the kernels run under the layer's ``conv_settings``, which
:func:`spatial_conv` takes from the job's runtime (``Runtime.conv``) with its transport and
timers.

Memory: forward keeps the input block (the previous layer holds it anyway) and copies of
the received margins, not the halo buffer (a second copy of the block); backward rebuilds
the extended block from them for the weight gradient only, and frees it at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.device.xp import array_module
from cosmotrain.kernels import conv3d
from cosmotrain.kernels.activation import leaky_relu_forward
from cosmotrain.kernels.cpu.channel_sums import channel_sums
from cosmotrain.layers.windowed import (SpatialWindow, WindowGeometry, finish_halo_grads,
                                         halo_buffer, restore_extended, save_margins,
                                         scatter_halo_grads)
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.boxes import Box
from cosmotrain.tensor.interior import (REDO_SHELL_MAX, OverlapPlan, conv_dims, overlap_plan,
                                        run_sub_conv)

Margins = list[tuple[Box, Any]]


@dataclass
class SpatialConv3d(SpatialWindow, Conv3d):
    """A :class:`Conv3d` whose input and output are :class:`DistTensor` blocks."""

    grid: ProcessGrid | None = None
    runtime: Runtime = field(default_factory=Runtime)  # the job's transport and timers
    _cache: dict = field(default_factory=dict, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    def forward(self, x: DistTensor, ctx: Context) -> DistTensor:  # type: ignore[override]
        geo = self.geometry(x)
        buffer = halo_buffer(x, geo)
        pending = geo.exchange.start(buffer, "replace")
        try:  # every call of _conv below applies the fused activation, if any
            y = self._overlapped(buffer[geo.extended], x, geo,
                                 lambda: geo.exchange.finish(buffer, pending, "replace"))
        finally:
            self._activation = None  # for this forward only
        self._saved = (x, save_margins(buffer, geo))
        return DistTensor(y, geo.out_dist, x.coord)

    def backward(self, dy: DistTensor, ctx: Context) -> DistTensor | None:  # type: ignore[override]
        (x, margins), self._saved = self._saved, None
        act, self._activation_grad = self._activation_grad, None
        geo = self.geometry(x)
        grad = pending = None
        if self.needs_input_grad:  # margins travel ...
            grad, pending = scatter_halo_grads(self._data_grad(dy, x, geo), x, geo)
        dw, db = self._weight_grad(x, margins, dy, geo, act)  # ... meanwhile
        self.params["weight"].accumulate(dw)
        if db is not None:
            self.params["bias"].accumulate(db)
        if pending is None:
            return None
        return finish_halo_grads(grad, pending, x, geo)

    def plan(self, x: DistTensor, geo: WindowGeometry) -> OverlapPlan:
        """The interior / shell calls for ``x``'s distribution (cached like the geometry)."""
        if x.dist not in self._plans:
            self._plans[x.dist] = overlap_plan(conv_dims(geo.halos, geo.plans, self.kernel,
                                                         self.stride))
        return self._plans[x.dist]

    def _overlapped(self, ext: Any, x: DistTensor, geo: WindowGeometry,
                    finish: Callable[[], None]) -> Any:
        """The output block, computing the interior while the exchange (``finish``) runs."""
        xp = array_module(x.data)
        if not geo.has_output:
            finish()
            return xp.zeros(geo.out_dist.local_shape(x.coord), x.data.dtype)
        plan = self.plan(x, geo)
        if plan.interior is None:  # every output reads a margin: wait, then one call
            finish()
            return self._conv(ext, geo.padding)
        if plan.shell_fraction <= REDO_SHELL_MAX:  # margins still zero: shell provisional
            y = self._conv(ext, geo.padding)
        else:
            y = xp.empty(geo.out_dist.local_shape(x.coord), x.data.dtype)
            run_sub_conv(self._conv, ext, plan.interior, y, self._padding_only)
        finish()
        for sub in plan.shell:
            run_sub_conv(self._conv, ext, sub, y, self._padding_only)
        return y

    def _padding_only(self, out: Any) -> None:
        """An output box whose windows read only padding: no products, so the bias (or
        zero), then the fused activation of it, as ``_conv`` would give."""
        out[...] = self.params["bias"].like(out).reshape(1, -1, 1, 1, 1) if self.bias else 0
        if self._activation is not None:  # a copy back when out is not contiguous
            out[...] = leaky_relu_forward(out, self._activation, inplace=True)

    def _conv(self, ext: Any, padding: Any) -> Any:
        """The convolution of (part of) the extended block, with the bias and the fused
        activation (:meth:`take_activation`): every output element's final value comes
        from one call, so each call adds and applies them (in the kernel's output chunks,
        as the one-process layer does, not in a pass after)."""
        bias = self.params["bias"].like(ext) if self.bias else None
        return conv3d.conv3d_forward(ext, self.params["weight"].like(ext), self.stride, padding,
                                     settings=self.conv_settings, bias=bias,
                                     activation=self._activation)

    def _data_grad(self, dy: DistTensor, x: DistTensor, geo: WindowGeometry) -> Any:
        """The extended block's data gradient (None for a rank without output)."""
        if not geo.has_output:
            return None
        return conv3d.conv3d_backward_data(dy.data, self.params["weight"].like(dy.data),
                                           geo.extended_shape(x.data.shape[:2]), self.stride,
                                           geo.padding, settings=self.conv_settings)

    def _weight_grad(self, x: DistTensor, margins: Margins, dy: DistTensor,
                     geo: WindowGeometry, act: Any = None) -> tuple[Any, Any]:
        """``(dL/dw, dL/db)`` of this block (``dL/db`` None without a bias); ``act``: the
        following LeakyReLU's ``(output block, slope)`` when this layer runs its backward
        (:meth:`take_activation_grad`)."""
        weight = self.params["weight"]
        if not geo.has_output:  # no output here: dy is empty, so is its activation's
            zeros = array_module(x.data).zeros(weight.shape, dtype=weight.data.dtype)
            return zeros, channel_sums(dy.data) if self.bias else None
        ext = restore_extended(x, margins, geo)
        if self.bias:
            return conv3d.conv3d_backward_filter_bias(ext, dy.data, weight.shape, self.stride,
                                                      geo.padding, activation=act,
                                                      settings=self.conv_settings)
        return conv3d.conv3d_backward_filter(ext, dy.data, weight.shape, self.stride,
                                             geo.padding, activation=act,
                                             settings=self.conv_settings), None


def spatial_conv(layer: Conv3d, grid: ProcessGrid, runtime: Runtime | None = None
                 ) -> SpatialConv3d:
    """The distributed twin of a :class:`Conv3d`, sharing its parameters, on the job's
    ``runtime`` (transport, timers, and the GPU kernel settings ``runtime.conv``)."""
    runtime = runtime or Runtime()
    return SpatialConv3d(name=layer.name, params=layer.params, in_channels=layer.in_channels,
                         out_channels=layer.out_channels, kernel=layer.kernel,
                         stride=layer.stride, padding=layer.padding, bias=layer.bias,
                         needs_input_grad=layer.needs_input_grad, grid=grid,
                         conv_settings=runtime.conv, runtime=runtime)
