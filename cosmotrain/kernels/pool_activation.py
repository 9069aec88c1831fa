"""The backward of a LeakyReLU followed by an average pooling, in one pass where it can.

Why: the paper network's act2 -> pool2 (and act3 -> pool3) ran the pooling's backward,
which writes the gradient of its input (32 x 64^3 floats a sample), then the
activation's backward, a second pass that reads that gradient and the activation's
output and writes the gradient again.  The compiled pooling loops multiply each row of
the gradient by the activation's factor as they finish it (:func:`.avgpool_compiled.
backward`): the same products, so the bits of the two passes
(tests/test_fused_activation.py).  Elsewhere (numpy kernels, other devices, bf16) the
two passes run as before.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from cosmotrain.kernels.compiled import avgpool as avgpool_compiled
from cosmotrain.kernels import pool3d
from cosmotrain.kernels.activation import leaky_relu_backward


def avg_pool_leaky_backward(dy: Any, y: Any, slope: float, kernel, stride,
                            padding) -> Any:
    """The gradient of ``y = LeakyReLU(slope)(z)``'s input z, given the output gradient
    ``dy`` of the average pooling of y (kernel, stride, padding as
    :func:`.pool3d.avg_pool3d_backward`)."""
    shape: Sequence[int] = y.shape
    pool = pool3d.PoolGeometry(shape, kernel, stride, padding)
    if (isinstance(dy, np.ndarray) and not pool.empty and avgpool_compiled.applies(dy)
            and avgpool_compiled.takes_activation(y, pool)):
        pool3d.check_pooled_grad(dy, pool)
        return avgpool_compiled.backward(np.ascontiguousarray(dy), pool, (y, slope))
    dx = pool3d.avg_pool3d_backward(dy, shape, kernel, stride, padding)
    return leaky_relu_backward(dx, y, slope, inplace=True)
