"""The factors a LeakyReLU's backward multiplies by, as every back end must round them.

numpy's pass computes ``dy * ((1 - slope) + slope)`` where ``y > 0`` and ``dy * slope``
elsewhere, and ``(1 - slope) + slope`` is not always 1 in float32.  The compiled loops
and our CUDA kernels take the two factors from here, so that every back end gives the
numpy pass's bits (tests/test_fused_activation.py, tests/test_cuda_kernels_host.py).
Shared by the front door and the back ends, like :mod:`.geometry`.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def backward_factors(slope: float, dtype: Any = np.float32) -> tuple[float, float]:
    """``(up, down)``: the factor the backward multiplies dy by where y > 0 and elsewhere,
    rounded as numpy builds it (``(1 - slope) + slope`` is not always 1), so that every
    loop applying it gives the numpy pass's bits."""
    factor = np.dtype(dtype).type(slope)
    return float((np.dtype(dtype).type(1) - factor) + factor), float(factor)
