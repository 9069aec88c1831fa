"""Storage precision: float32 or bfloat16 activations, always float32 arithmetic.

``device.precision: bf16`` stores activations and their gradients as bfloat16
(``ml_dtypes.bfloat16``, which numpy and cupy 14 both accept as a dtype) and keeps the
master weights, their gradients and the optimizer state in float32.  Every kernel
accumulates in float32: on the GPU the convolutions read bf16 directly (tensor cores,
fp32 accumulation); every other kernel, and every kernel on the CPU, *widens* its bf16
inputs to float32 at its boundary, computes in float32 and *narrows* the results it
stores back to bf16.  On the CPU this is an emulation for validation (slow: two extra
passes per kernel), which is what lets CI show that a bf16 step matches fp32 within 1e-2.

The dtype is recognised by name, so nothing here imports ml_dtypes until a bf16 array
has to be made.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BF16 = "bfloat16"
PRECISIONS = ("fp32", "tf32", "bf16")


def bfloat16() -> np.dtype:
    """The bfloat16 dtype (``ml_dtypes``; ImportError naming the fix when missing)."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("bfloat16 storage needs ml_dtypes: pip install ml_dtypes "
                          '(or pip install -e ".[gpu]")') from None
    return np.dtype(ml_dtypes.bfloat16)


def is_bf16(array: Any) -> bool:
    """Whether ``array`` (numpy or cupy) stores bfloat16."""
    dtype = getattr(array, "dtype", None)
    return dtype is not None and dtype.name == BF16


def widen(array: Any) -> Any:
    """A bfloat16 array as float32 (a new array); anything else unchanged (no copy)."""
    return array.astype(np.float32) if is_bf16(array) else array


def narrow(array: Any) -> Any:
    """A float32 result rounded to bfloat16 storage (round to nearest even)."""
    return array.astype(bfloat16())


def storage_dtype(precision: str) -> np.dtype:
    """The activation dtype of a precision: bfloat16 for ``bf16``, else float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return bfloat16() if precision == "bf16" else np.dtype(np.float32)


def accumulator(dtype: Any) -> np.dtype:
    """The dtype sums of ``dtype`` values are accumulated in: float32 for bfloat16."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.name == BF16 else dtype
