"""The backward of a LeakyReLU followed by an average pooling, in one pass where it can.

Why: the paper network's act2 -> pool2 (and act3 -> pool3) ran the pooling's backward,
which writes the gradient of its input (32 x 64^3 floats a sample), then the
activation's backward, a second pass that reads that gradient and the activation's
output and writes the gradient again.  The compiled pooling loops multiply each row of
the gradient by the activation's factor as they finish it (:func:`.compiled.avgpool.
backward`): the same products, so the bits of the two passes
(tests/test_fused_activation.py).  float32 and bf16 device arrays take our CUDA kernel,
a gather that applies the factor as it stores (``kernels/cuda/src/avgpool.cu``: the
float32 bits; bf16 read and written directly, one rounding where the two passes round
twice).  Elsewhere (numpy kernels, other dtypes, bf16 on the CPU) the two passes run as
before.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from cosmotrain.kernels import pool3d
from cosmotrain.kernels.activation import leaky_relu_backward
from cosmotrain.kernels.compiled import avgpool as avgpool_compiled
from cosmotrain.kernels.route import route


def avg_pool_leaky_backward(dy: Any, y: Any, slope: float, kernel, stride,
                            padding, launch: Optional[Callable] = None) -> Any:
    """The gradient of ``y = LeakyReLU(slope)(z)``'s input z, given the output gradient
    ``dy`` of the average pooling of y (kernel, stride, padding as
    :func:`.pool3d.avg_pool3d_backward`).  ``launch``: our CUDA kernel through another
    launcher, on any arrays (the tests: its host build)."""
    shape: Sequence[int] = y.shape
    pool = pool3d.PoolGeometry(shape, kernel, stride, padding)
    where = route(dy)
    if ((where.device or launch is not None) and not pool.empty
            and dy.dtype == y.dtype and dy.dtype.name in ("float32", "bfloat16")):
        from cosmotrain.kernels.cuda import raw_ops
        pool3d.check_pooled_grad(dy, pool)
        return raw_ops.avg_pool_backward(_contiguous(dy), pool, _contiguous(y), slope,
                                         launch=launch)
    if (not where.device and not pool.empty and avgpool_compiled.applies(dy)
            and avgpool_compiled.takes_activation(y, pool)):
        pool3d.check_pooled_grad(dy, pool)
        return avgpool_compiled.backward(np.ascontiguousarray(dy), pool, (y, slope))
    dx = pool3d.avg_pool3d_backward(dy, shape, kernel, stride, padding)
    return leaky_relu_backward(dx, y, slope, inplace=True)


def _contiguous(array: Any) -> Any:
    """``array`` C-contiguous (a halo buffer's owned planes are a strided view)."""
    return array if array.flags.c_contiguous else array.copy(order="C")
