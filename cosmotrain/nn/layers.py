"""Single-process layers: thin wrappers that call the device kernels.

The distributed layers (``cosmotrain/layers``) subclass these: window layers replace
forward/backward to work on halo-extended blocks; batch norm overrides
``reduce_sums`` to reduce its statistics over the ranks sharing them; dropout overrides
``block_geometry`` to place a block in the global tensor.  Every layer accepts an empty
batch (a rank that holds no sample after a redistribution still takes part).

Convolutions and linear layers carry the GPU kernel settings they pass to every kernel
call (``conv_settings``, a :class:`~cosmotrain.kernels.cuda.settings.ConvSettings`): the
defaults in a model as built, the job's (``Runtime.conv``) in the twins that
:func:`cosmotrain.layers.hybrid.build_hybrid` makes.  numpy kernels ignore them.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cosmotrain.device.xp import array_module, is_device_array
from cosmotrain.kernels import conv3d, pool3d
from cosmotrain.kernels.geometry import Padding, Triple, output_size
from cosmotrain.kernels.activation import leaky_relu_backward, leaky_relu_forward
from cosmotrain.kernels.batchnorm import (bn_backward_apply, bn_backward_local_sums, bn_count,
                                          bn_local_sums, bn_normalize, bn_statistics,
                                          bn_train_forward, bn_unbiased_factor)
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.kernels.dropout import dropout_backward, dropout_forward, dropout_mask
from cosmotrain.kernels.linear import (linear_backward_data, linear_backward_weight,
                                       linear_forward)
from cosmotrain.kernels.pool_activation import avg_pool_leaky_backward
from cosmotrain.nn.module import Context, Layer
from cosmotrain.precision import accumulator, widen


def window_output_shape(shape: tuple[int, ...], channels: int, kernel: Triple,
                        stride: Triple, padding: Padding) -> tuple[int, ...]:
    """(N, channels, Do, Ho, Wo) of a sliding window (convolution or pooling)."""
    spatial = tuple(output_size(s, k, st, lo, hi) for s, k, st, (lo, hi) in
                    zip(shape[2:], kernel, stride, padding))
    return (shape[0], channels) + spatial


@dataclass
class Conv3d(Layer):
    """3D cross-correlation, weight F x C x kD x kH x kW (PyTorch layout), optional bias."""

    in_channels: int = 1
    out_channels: int = 1
    kernel: Triple = (3, 3, 3)
    stride: Triple = (1, 1, 1)
    padding: Padding = ((1, 1), (1, 1), (1, 1))
    bias: bool = False
    conv_settings: ConvSettings = field(default_factory=ConvSettings, repr=False)
    _activation = None  # the following LeakyReLU's slope when this layer applies it
    _activation_grad = None  # (y, slope) of the LeakyReLU after it, for this backward

    def take_activation(self, slope: float | None) -> bool:
        """The kernels apply a LeakyReLU to each output chunk while it is in cache (the
        next forward only: a call outside a Sequential applies none)."""
        self._activation = slope if slope is not None and 0.0 <= slope <= 1.0 else None
        return self._activation is not None

    def take_activation_grad(self, y: Any, slope: float) -> bool:
        """Taken without an input gradient to compute: dy then serves only the filter
        (and bias) gradient, whose loops multiply it by the factor as they read it."""
        if self.needs_input_grad:
            return False
        self._activation_grad = (y, slope)  # spent by the next backward
        return True

    def forward(self, x: Any, ctx: Context) -> Any:
        self._x = x
        activation, self._activation = self._activation, None  # for this call only
        if x.shape[0] == 0:
            return array_module(x).zeros(self.output_shape(x.shape), x.dtype)
        bias = self.params["bias"].like(x) if self.bias else None
        return conv3d.conv3d_forward(x, self.params["weight"].like(x), self.stride,
                                     self.padding, settings=self.conv_settings, bias=bias,
                                     activation=activation)

    def backward(self, dy: Any, ctx: Context) -> Any:
        x, self._x = self._x, None
        act, self._activation_grad = self._activation_grad, None
        weight = self.params["weight"]
        if x.shape[0] == 0:
            return self._empty_backward(x)
        if self.bias:  # both from one pass over dy where the kernels can
            dw, db = conv3d.conv3d_backward_filter_bias(x, dy, weight.shape, self.stride,
                                                        self.padding, activation=act,
                                                        settings=self.conv_settings)
            weight.accumulate(dw)
            self.params["bias"].accumulate(db)
        else:
            weight.accumulate(conv3d.conv3d_backward_filter(x, dy, weight.shape, self.stride,
                                                            self.padding, activation=act,
                                                            settings=self.conv_settings))
        if not self.needs_input_grad:
            return None
        return conv3d.conv3d_backward_data(dy, weight.like(dy), x.shape, self.stride,
                                           self.padding, settings=self.conv_settings)

    def _empty_backward(self, x: Any) -> Any:
        """No sample here: zero parameter gradients (this rank's share of the sum)."""
        xp = array_module(x)
        for param in self.params.values():
            param.accumulate(xp.zeros(param.shape, param.data.dtype))
        return xp.zeros(x.shape, x.dtype) if self.needs_input_grad else None

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return window_output_shape(shape, self.out_channels, self.kernel, self.stride,
                                   self.padding)


@dataclass
class Pool3d(Layer):
    """Average (zero padding counted in the divisor) or max pooling."""

    mode: str = "avg"
    kernel: Triple = (3, 3, 3)
    stride: Triple = (2, 2, 2)
    padding: Padding = ((1, 1), (1, 1), (1, 1))
    _activation_before = None  # (y, slope) of the LeakyReLU before it, for this backward

    def forward(self, x: Any, ctx: Context) -> Any:
        self._x_shape = x.shape
        if x.shape[0] == 0:
            return array_module(x).zeros(self.output_shape(x.shape), x.dtype)
        if self.mode == "avg":
            return pool3d.avg_pool3d_forward(x, self.kernel, self.stride, self.padding)
        y, self._argmax = pool3d.max_pool3d_forward(x, self.kernel, self.stride, self.padding)
        return y

    def take_preceding_activation(self, before: Sequence[Layer]) -> None:
        if self.mode == "avg" and self.needs_input_grad and before:
            self._activation_before = before[-1].give_backward_to_next(before[:-1])

    def backward(self, dy: Any, ctx: Context) -> Any:
        activation, self._activation_before = self._activation_before, None
        if not self.needs_input_grad:
            return None
        if activation is not None and self._x_shape[0]:
            return avg_pool_leaky_backward(dy, *activation, self.kernel, self.stride,
                                           self.padding)
        if self._x_shape[0] == 0:
            return array_module(dy).zeros(self._x_shape, dy.dtype)
        if self.mode == "avg":
            return pool3d.avg_pool3d_backward(dy, self._x_shape, self.kernel, self.stride,
                                              self.padding)
        argmax, self._argmax = self._argmax, None
        return pool3d.max_pool3d_backward(dy, argmax, self._x_shape, self.kernel,
                                          self.stride, self.padding)

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return window_output_shape(shape, shape[1], self.kernel, self.stride, self.padding)


@dataclass
class LeakyReLU(Layer):
    """In-place LeakyReLU (``slope=0`` is ReLU); keeps only its output for backward."""

    slope: float = 0.01
    _applied = False  # the layer before applied it to its output (Layer.take_activation)
    _taken = False  # its backward went to a neighbour early (give_backward_to_next)

    def activation_slope(self) -> float | None:
        return self.slope

    def set_applied_by_previous(self, applied: bool) -> None:
        self._applied = applied

    def forward(self, x: Any, ctx: Context) -> Any:
        applied, self._applied = self._applied, False  # for this call only
        self._y = x if applied else leaky_relu_forward(x, self.slope, inplace=True)
        return self._y

    def hand_over_backward(self, before: Sequence[Layer]) -> bool:
        if self._taken:  # a neighbour took it already (give_backward_to_next)
            self._taken = False
            return True
        if not before[-1].take_activation_grad(self._y, self.slope):
            return False
        self._y = None  # the layer before holds it until its backward
        return True

    def give_backward_to_next(self, before: Sequence[Layer]) -> tuple[Any, float] | None:
        """Asked by the layer after this one (an average pooling) before its backward:
        ``(y, slope)`` for it to run this backward in its own pass, unless the layer
        before this one takes it in its kernels (that costs no pass at all).  Either way
        this backward is then done (:meth:`hand_over_backward` skips it)."""
        if not before or self._y is None:
            return None
        self._taken = True
        if before[-1].take_activation_grad(self._y, self.slope):
            self._y = None
            return None
        y, self._y = self._y, None
        return y, self.slope

    def backward(self, dy: Any, ctx: Context) -> Any:
        y, self._y = self._y, None
        return leaky_relu_backward(dy, y, self.slope, inplace=True)


@dataclass
class BatchNorm3d(Layer):
    """Batch norm over (N, D, H, W) per channel; running statistics for evaluation.

    ``reduce_sums`` is where the distributed layer allreduces the per-channel sums over
    the ranks that share a sample (and optionally the samples); here it is the identity.
    """

    channels: int = 1
    eps: float = 1e-5
    momentum: float = 0.1
    # Whether a count of 0 keeps the running statistics (the distributed layer's rule).
    _GUARDS_EMPTY_GROUPS = False

    def reduce_sums(self, sums: Any) -> Any:
        return sums

    def forward(self, x: Any, ctx: Context) -> Any:
        if not ctx.training:
            y, _, _ = bn_normalize(x, self.buffers["running_mean"],
                                   self.buffers["running_var"], self.params["weight"].data,
                                   self.params["bias"].data, self.eps, keep_xhat=False)
            return y
        sums = self.reduce_sums(bn_local_sums(x))
        self._count = bn_count(sums)
        trained = bn_train_forward(x, sums, self.params["weight"].data,
                                   self.params["bias"].data, self.buffers, self.eps,
                                   self.momentum, self._GUARDS_EMPTY_GROUPS)
        if trained is not None:  # on a device, in one launch
            self.buffers["num_batches_tracked"] = self.buffers["num_batches_tracked"] + 1
            y, self._xhat, self._inv_std = trained
            return y
        mean, var = bn_statistics(sums)
        self._update_running(mean, var)
        y, self._xhat, self._inv_std = bn_normalize(x, mean, var, self.params["weight"].data,
                                                    self.params["bias"].data, self.eps)
        return y

    def _update_running(self, mean: Any, var: Any) -> None:
        """PyTorch's rule: unbiased variance, exponential average with ``momentum``."""
        self._store_running(self._running_values(mean, var))
        self.buffers["num_batches_tracked"] = self.buffers["num_batches_tracked"] + 1

    def _running_values(self, mean: Any, var: Any) -> dict[str, Any]:
        """The running statistics after this batch (not yet stored)."""
        unbiased = var * bn_unbiased_factor(self._count)
        m = self.momentum
        dtype = self.buffers["running_mean"].dtype
        return {"running_mean": ((1 - m) * self.buffers["running_mean"] + m * mean).astype(dtype),
                "running_var": ((1 - m) * self.buffers["running_var"] + m * unbiased
                                ).astype(dtype)}

    def _store_running(self, values: dict[str, Any], where: Any = True) -> None:
        """Store :meth:`_running_values`: on the CPU as new arrays; on a device into the
        buffers in place (a captured CUDA graph replays into the buffers it captured),
        only where the device flag ``where`` is set."""
        for key, value in values.items():
            held = self.buffers[key]
            if is_device_array(held):
                array_module(held).copyto(held, value, where=where)
            else:
                self.buffers[key] = value

    def backward(self, dy: Any, ctx: Context) -> Any:
        xhat, self._xhat = self._xhat, None
        local = bn_backward_local_sums(dy, xhat)
        gamma = self.params["weight"]
        # The local sums are this rank's part of dbeta / dgamma: like every parameter
        # gradient they are summed over the parameter's replicas by the trainer.
        self.params["bias"].accumulate(local[0].astype(gamma.data.dtype))
        gamma.accumulate(local[1].astype(gamma.data.dtype))
        sums = self.reduce_sums(local)
        if not self.needs_input_grad:
            return None
        return bn_backward_apply(dy, xhat, gamma.data, self._inv_std, sums, self._count)


@dataclass
class Dropout(Layer):
    """Inverted dropout whose mask depends only on (seed, step, layer, global index)."""

    p: float = 0.5

    def _salt(self) -> int:
        return zlib.crc32(self.name.encode())

    def block_geometry(self, x: Any, ctx: Context) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offset, global shape) of the local block: local samples in the global batch."""
        batch = ctx.global_batch if ctx.global_batch is not None else x.shape[0]
        return (ctx.sample_offset,) + (0,) * (x.ndim - 1), (batch,) + x.shape[1:]

    def forward(self, x: Any, ctx: Context) -> Any:
        if not ctx.training or self.p == 0.0:
            self._keep = None
            return x
        offset, global_shape = self.block_geometry(x, ctx)
        self._keep = dropout_mask(x, offset, global_shape, self.p, ctx.seed, ctx.step,
                                  self._salt(), ctx.device_step)
        return dropout_forward(x, self._keep, self.p)

    def backward(self, dy: Any, ctx: Context) -> Any:
        keep, self._keep = self._keep, None
        return dy if keep is None else dropout_backward(dy, keep, self.p)


@dataclass
class Flatten(Layer):
    """(N, C, D, H, W) -> (N, C*D*H*W) in C, D, H, W order (PyTorch's flatten)."""

    def forward(self, x: Any, ctx: Context) -> Any:
        self._shape = x.shape
        return x.reshape(self.output_shape(x.shape))

    def backward(self, dy: Any, ctx: Context) -> Any:
        return dy.reshape(self._shape)

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        size = 1
        for s in shape[1:]:
            size *= s
        return (shape[0], size)


@dataclass
class Linear(Layer):
    """y = x W^T + b with W (out, in), PyTorch layout."""

    in_features: int = 1
    out_features: int = 1
    conv_settings: ConvSettings = field(default_factory=ConvSettings, repr=False)  # its math

    def forward(self, x: Any, ctx: Context) -> Any:
        self._x = x
        bias = self.params.get("bias")
        return linear_forward(x, self.params["weight"].like(x), bias.like(x) if bias else None,
                              settings=self.conv_settings)

    def backward(self, dy: Any, ctx: Context) -> Any:
        x, self._x = self._x, None
        dw, db = linear_backward_weight(x, dy, settings=self.conv_settings)
        self.params["weight"].accumulate(dw)
        if "bias" in self.params:
            self.params["bias"].accumulate(db)
        if not self.needs_input_grad:
            return None
        return linear_backward_data(dy, self.params["weight"].like(dy),
                                    settings=self.conv_settings)

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[0], self.out_features)


@dataclass
class ScaledTanh(Layer):
    """``scale * tanh(x)``: the MLPerf CosmoFlow output layer (scale 1.2)."""

    scale: float = 1.2
    _t: Any = field(default=None, repr=False)

    def forward(self, x: Any, ctx: Context) -> Any:
        self._t = array_module(x).tanh(widen(x))  # bf16: float32 math, on a few values
        return (self._t * self._t.dtype.type(self.scale)).astype(x.dtype, copy=False)

    def backward(self, dy: Any, ctx: Context) -> Any:
        t, self._t = self._t, None
        grad = widen(dy) * (1 - t * t) * t.dtype.type(self.scale)
        return grad.astype(dy.dtype, copy=False)


@dataclass
class GlobalAvgPool(Layer):
    """Mean over (D, H, W): (N, C, D, H, W) -> (N, C, 1, 1, 1) (runs on whole samples)."""

    def forward(self, x: Any, ctx: Context) -> Any:
        self._x_shape = x.shape
        self._volume = x.shape[2] * x.shape[3] * x.shape[4]
        total = accumulator(x.dtype)
        mean = x.sum(axis=(2, 3, 4), keepdims=True, dtype=total) / total.type(self._volume)
        return mean.astype(x.dtype, copy=False)

    def backward(self, dy: Any, ctx: Context) -> Any:
        xp = array_module(dy)
        scaled = widen(dy) / accumulator(dy.dtype).type(self._volume)
        return xp.broadcast_to(scaled.astype(dy.dtype, copy=False), self._x_shape).copy()

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[:2] + (1, 1, 1)
