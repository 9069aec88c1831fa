"""3D convolution: forward, data gradient, filter gradient — the front door.

Conventions: NCDHW float arrays (float32 in training; float64 accepted, the tests use
it), weights ``(F, C, kD, kH, kW)`` as in PyTorch (cross-correlation), stride a triple,
padding one ``(lo, hi)`` pair of zeros per spatial dimension (asymmetric: a block that
already carries halos is called with 0 on those sides, see :mod:`.geometry`).  Output
``Do = (D + lo + hi - kD) // sD + 1``.  A batch of no sample (``N = 0``, a sample group
left empty by a short batch) gives empty results and a zero weight gradient on any device.

Routing, decided once per call (:func:`.route.route`): cupy arrays go to the GPU kernels of
the same names (:mod:`.cuda.conv`, which imports cupy on first use), with the call's
``settings`` (the :class:`~.cuda.settings.ConvSettings` the layer was built with; None:
the defaults; the CPU ignores them); bfloat16 numpy arrays are widened to float32,
convolved on the CPU and the result rounded back to bfloat16 (:mod:`cosmotrain.precision`);
under ``settings.conv1_algorithm: direct`` a cupy forward of few input channels goes to
our direct kernel with the bias and activation fused (:mod:`.cuda.conv1`);
float32 and float64 numpy arrays go to the compiled loops where :mod:`.compiled.choice`
picks them (float32, unit stride: Winograd or direct) and otherwise to the GEMM lowerings
of :mod:`.cpu.conv_gemm`, whose docstring has the algorithms and the measurements behind
them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.activation import (bias_leaky_relu, leaky_relu_backward,
                                           leaky_relu_forward)
from cosmotrain.kernels.compiled import choice as compiled_choice, direct, winograd
from cosmotrain.kernels.cpu import conv_gemm
from cosmotrain.kernels.cpu.channel_sums import channel_sums
from cosmotrain.kernels.cuda import conv as cuda_conv, conv1 as cuda_conv1
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.kernels.geometry import ConvGeometry, PaddingLike
from cosmotrain.kernels.route import require_cpu_out, route
from cosmotrain.precision import narrow, widen


def as_float_array(a: np.ndarray, name: str, dtype=None) -> np.ndarray:
    """C-contiguous floating array (no copy when it already is one)."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        raise ValueError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def output_buffer(out: Optional[np.ndarray], shape, dtype, name: str = "out") -> np.ndarray:
    """``out`` checked for shape, dtype and contiguity, or a new uninitialised array."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous {np.dtype(dtype).name} array of shape "
                         f"{tuple(shape)}, got {out.dtype.name} {out.shape}")
    return out


def _no_samples(like: np.ndarray, shape: Sequence[int], out: Optional[np.ndarray] = None
                ) -> np.ndarray:
    """The result of a call on a batch of no sample: empty, or zeros for a weight gradient.

    Why: a sample group that holds no sample of a short batch (a last partial batch, a
    1-sample validation split) still runs its layers so that its halo exchanges and
    collectives pair with the other ranks'; its convolutions compute nothing.  Answered
    before the device dispatch, so no backend (cuDNN, the bf16 emulation) sees N = 0.
    """
    if out is not None:
        return output_buffer(out, shape, like.dtype)
    return array_module(like).zeros(tuple(shape), dtype=like.dtype)


def conv3d_forward(x: np.ndarray, w: np.ndarray, stride: "int | Sequence[int]" = 1,
                   padding: PaddingLike = 0, *, out: Optional[np.ndarray] = None,
                   settings: Optional[ConvSettings] = None,
                   bias: Optional[np.ndarray] = None,
                   activation: Optional[float] = None) -> np.ndarray:
    """``y = conv3d(x, w) + bias``: x (N,C,D,H,W), w (F,C,kD,kH,kW), bias (F,) or None
    -> y (N,F,Do,Ho,Wo); then LeakyReLU with slope ``activation`` unless it is None.

    ``out``: optional C-contiguous result buffer (reusing one saves the page faults of a
    fresh allocation, about 5 ms per 128 MiB here).  ``bias``: added by the CPU kernels
    to each chunk's output while it is in cache (the same float adds as ``y += bias``
    afterwards, which cost a pass over the output: 40 ms on the MLPerf conv1's 2 x 32 x
    128^3); on a device our epilogue kernel adds it with the activation in one pass
    (:func:`.activation.bias_leaky_relu`), and bf16 on the CPU adds it afterwards, in the
    output's dtype.
    ``activation``: the following LeakyReLU layer's forward (:mod:`.activation`), which
    the compiled loops apply to each register run while it is in cache instead of in a
    pass of its own over the output (paper network, batch 1: 8.5 ms of act1), with the
    same arithmetic, so the same bits; the other paths run that pass after the output.
    """
    if x.shape[0] == 0:  # zeros: LeakyReLU leaves them
        return _no_samples(x, ConvGeometry.create(x.shape, w.shape, stride, padding).y_shape,
                           out)
    where = route(x, w)
    if not where.cpu_float:
        require_cpu_out(out, where)
        if where.device and cuda_conv1.takes_direct(x, w.shape, stride, settings):
            return cuda_conv1.direct_forward(x, w, padding, bias, activation)  # fused
        if where.device:
            y = cuda_conv.conv3d_forward(x, w, stride, padding, settings=settings)
        else:
            y = narrow(conv3d_forward(widen(x), widen(w), stride, padding))
        return bias_leaky_relu(y, bias, activation)
    x = as_float_array(x, "x")
    w = as_float_array(w, "w", x.dtype)
    geo = ConvGeometry.create(x.shape, w.shape, stride, padding)
    y = output_buffer(out, geo.y_shape, x.dtype)
    if bias is not None:
        bias = as_float_array(bias, "bias", x.dtype)
        geo.check("bias", bias.shape, (geo.filters,))
    kernel = compiled_choice.forward_kernel(geo, x.dtype)
    if kernel == "winograd":
        return winograd.forward(x, w, geo, y, bias, compiled_choice.winograd_tile(geo),
                                slope=activation)
    if kernel == "direct":
        return direct.forward(x, w, geo, y, bias, slope=activation)
    y = conv_gemm.forward(x, w, geo, y, bias)
    return y if activation is None else leaky_relu_forward(y, activation)


def conv3d_backward_filter(x: np.ndarray, dy: np.ndarray, w_shape: Sequence[int],
                           stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                           activation: Optional[tuple[np.ndarray, float]] = None,
                           settings: Optional[ConvSettings] = None) -> np.ndarray:
    """``dL/dw`` from the input x and the output gradient dy; shape ``w_shape``.

    bf16 (CPU emulation): computed in float32, returned as bf16 like the GPU kernel.
    No sample (``N = 0``): zeros, the empty sum.  ``activation``: ``(y, slope)`` of the
    LeakyReLU after this layer, whose backward comes first (dy times its factor of y):
    inside the direct loops' packing of dy where they run, else as its own pass over
    dy, in place (what the activation layer would have done)."""
    return _filter_grads(x, dy, w_shape, stride, padding, False, activation, settings)[0]


def conv3d_backward_filter_bias(x: np.ndarray, dy: np.ndarray, w_shape: Sequence[int],
                                stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0,
                                *, activation: Optional[tuple[np.ndarray, float]] = None,
                                settings: Optional[ConvSettings] = None
                                ) -> tuple[np.ndarray, np.ndarray]:
    """``(dL/dw, dL/db)``: :func:`conv3d_backward_filter` and the bias gradient (dy summed
    over every axis but 1), which the compiled loops take from the dy tiles they pack
    anyway, in cache; other paths run :func:`.channel_sums.channel_sums`, a pass of its own
    (MLPerf conv1: 20 ms on one core).  The loops sum tile by tile in vector lanes: their
    last bits differ from numpy's pairwise sums."""
    return _filter_grads(x, dy, w_shape, stride, padding, True, activation, settings)


def _filter_grads(x: np.ndarray, dy: np.ndarray, w_shape: Sequence[int],
                  stride: "int | Sequence[int]", padding: PaddingLike, bias: bool,
                  activation: Optional[tuple[np.ndarray, float]],
                  settings: Optional[ConvSettings]) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(dL/dw, dL/db or None)`` of the two functions above."""
    geo = ConvGeometry.create(x.shape, w_shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    where = route(x, dy)  # only the CPU's direct loops pack the activation's backward
    if activation is not None and not (x.shape[0] and where.cpu_float and
                                       compiled_choice.packs_activation_grad(
                                           geo, x, dy, activation[0])):
        dy, activation = leaky_relu_backward(dy, *activation), None  # its own pass, in place
    if x.shape[0] == 0:
        return _no_samples(x, geo.w_shape), channel_sums(dy) if bias else None
    if not where.cpu_float:
        if where.device:
            dw = cuda_conv.conv3d_backward_filter(x, dy, w_shape, stride, padding,
                                                  settings=settings)
        else:
            dw = narrow(conv3d_backward_filter(widen(x), widen(dy), w_shape, stride, padding))
        return dw, channel_sums(dy) if bias else None
    x = as_float_array(x, "x")
    dy = as_float_array(dy, "dy", x.dtype)
    kernel = compiled_choice.filter_grad_kernel(geo, x.dtype)
    if kernel == "winograd":
        return winograd.filter_and_bias_grad(x, dy, geo, compiled_choice.winograd_tile(geo),
                                             bias)
    if kernel == "direct":
        return direct.filter_and_bias_grad(x, dy, geo, bias, activation)
    return conv_gemm.filter_grad(x, dy, geo), channel_sums(dy) if bias else None


def conv3d_backward_data(dy: np.ndarray, w: np.ndarray, x_shape: Sequence[int],
                         stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0,
                         *, out: Optional[np.ndarray] = None,
                         settings: Optional[ConvSettings] = None) -> np.ndarray:
    """``dL/dx`` from the output gradient dy and the weights; shape ``x_shape``."""
    if dy.shape[0] == 0:
        geo = ConvGeometry.create(x_shape, w.shape, stride, padding)
        geo.check("dy", dy.shape, geo.y_shape)
        return _no_samples(dy, geo.x_shape, out)
    where = route(dy, w)
    if not where.cpu_float:
        require_cpu_out(out, where)
        if where.device:
            return cuda_conv.conv3d_backward_data(dy, w, x_shape, stride, padding,
                                                  settings=settings)
        return narrow(conv3d_backward_data(widen(dy), widen(w), x_shape, stride, padding))
    dy = as_float_array(dy, "dy")
    w = as_float_array(w, "w", dy.dtype)
    geo = ConvGeometry.create(x_shape, w.shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    dx = output_buffer(out, geo.x_shape, dy.dtype)
    if conv_gemm.scatters(geo):
        return conv_gemm.data_grad(dy, w, geo, dx)
    flipped, tgeo = conv_gemm.transposed(w, geo, dy.shape)
    kernel = compiled_choice.data_grad_kernel(tgeo, geo.channels, dy.dtype)
    if kernel == "winograd":
        return winograd.forward(dy, flipped, tgeo, dx, None, compiled_choice.winograd_tile(tgeo))
    if kernel == "direct":
        return direct.forward(dy, flipped, tgeo, dx)
    return conv_gemm.data_grad(dy, w, geo, dx)
