"""Fully connected layer, PyTorch layout: weight (out, in), y = x @ W^T + b.

bfloat16 operands are multiplied in float32 (widened, the output rounded back to bf16;
the weight gradient stays float32).  On the GPU the products run under the math mode of
the call's ``settings`` (a :class:`~cosmotrain.kernels.cuda.settings.ConvSettings`, the
one the layer was built with; None: the defaults, strict fp32): ``math: tf32``
(``device.precision: tf32``) allows TF32 tensor cores, see
:func:`cosmotrain.kernels.cuda.settings.cublas_math`.  numpy operands ignore it.

``dense: kernels`` sends device calls to our own kernels instead of cuBLAS
(:mod:`cosmotrain.kernels.cuda.raw_linear`, ``src/linear.cu``: what a CUDA graph can
capture): strict float32 arithmetic, bf16 operands read as stored and the result
rounded once, no widening or narrowing pass.  They take C-contiguous operands of one
storage dtype, float32 or bf16 (what the layers hand them); any other call keeps the
cuBLAS path.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cuda import raw_linear
from cosmotrain.kernels.cuda.settings import ConvSettings, cublas_math, resolve_settings
from cosmotrain.kernels.route import route
from cosmotrain.precision import narrow, widen


def _math(x: Any, settings: ConvSettings | None) -> ContextManager[None]:
    """The GEMM math mode of ``settings`` for cupy operands; nothing for numpy."""
    if not route(x).device:
        return nullcontext()
    return cublas_math(array_module(x), resolve_settings(settings).math == "tf32")


def _own_kernels(settings: ConvSettings | None, *arrays: Any) -> bool:
    """Whether this call runs our dense kernels: device operands under ``dense:
    kernels``, C-contiguous, of one storage dtype (float32 or bf16)."""
    if not route(*arrays).device or resolve_settings(settings).dense != "kernels":
        return False
    present = [a for a in arrays if a is not None]
    return (present[0].dtype.name in ("float32", "bfloat16")
            and all(a.dtype == present[0].dtype and a.flags.c_contiguous for a in present))


def linear_forward(x: Any, weight: Any, bias: Any | None, *,
                   settings: ConvSettings | None = None) -> Any:
    if _own_kernels(settings, x, weight, bias):
        return raw_linear.forward(x, weight, bias)
    where = route(x)
    if where.bf16:
        return narrow(linear_forward(widen(x), widen(weight),
                                     None if bias is None else widen(bias), settings=settings))
    with _math(x, settings):
        y = x @ weight.T
    if bias is not None:
        y += bias
    return y


def linear_backward_data(dy: Any, weight: Any, *, settings: ConvSettings | None = None) -> Any:
    if _own_kernels(settings, dy, weight):
        return raw_linear.backward_data(dy, weight)
    where = route(dy)
    if where.bf16:
        return narrow(linear_backward_data(widen(dy), widen(weight), settings=settings))
    with _math(dy, settings):
        return dy @ weight


def linear_backward_weight(x: Any, dy: Any, *, settings: ConvSettings | None = None
                           ) -> tuple[Any, Any]:
    """(dW, db) for this block of samples (to be summed over the sample replicas).

    One sample on the CPU: an outer product, the same single products as the GEMM (no sums
    to order differently).  OpenBLAS's sgemm with an inner dimension of 1 took 4.9 ms for
    the paper network's fc1 (2048 x 2048) on the 2-core machine, ``np.outer`` 1.5-1.7 ms.
    Under ``dense: kernels`` one launch gives both, float32 (bf16 read as stored).
    """
    if _own_kernels(settings, x, dy):
        return raw_linear.backward_weight(x, dy)
    where = route(dy)
    if where.bf16:
        return linear_backward_weight(widen(x), widen(dy), settings=settings)
    if dy.shape[0] == 1 and not where.device:
        return np.outer(dy[0], x[0]), dy.sum(axis=0)
    with _math(dy, settings):
        return dy.T @ x, dy.sum(axis=0)
