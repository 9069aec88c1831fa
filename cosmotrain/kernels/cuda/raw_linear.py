"""Python faces of the dense head's own CUDA kernels (``src/linear.cu``): forward with
the bias fused, the data gradient, and the weight gradient with the bias gradient.

Why our own: a CUDA graph cannot capture cuBLAS (cupy refuses ``cublas.setStream``
during capture), so a captured step cannot run the head through ``cupy.matmul``.
:mod:`cosmotrain.kernels.linear` sends device calls here under
``ConvSettings.dense == "kernels"``.

As in :mod:`.raw_ops`: ``launch`` is :func:`.raw.cupy_launch` unless a caller hands
another (tests/cuda_host.py runs the same source on the CPU), no face reads anything
back from the device, arrays are C-contiguous float32 or bfloat16 storage (the dtype
picks the ``_f32`` / ``_bf16`` entry point), and every operand but the float32 weight
gradient has the activations' dtype (what ``Parameter.like`` hands the layer).

Launches (the head of the paper network: fc1 2048 -> 2048, fc2 2048 -> 256, fc3 256 ->
4 at W = 128; MLPerf's: 32,768 -> 128 -> 64 -> 4): forward and data gradient one launch
when one thread per output and tile of :data:`TILE` samples already fills the device,
else two (the inner dimension split into :func:`chunk_for` chunks, then their sums
added); the weight gradient one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cuda import raw
from cosmotrain.kernels.cuda.raw_ops import Launch

TILE = 8  # LINEAR_TILE in linear.cu: samples per thread
# Threads a pass aims at (a few waves of an H200's 132 SMs x 2,048), and the shortest
# chunk of the inner dimension a thread adds: with fewer outputs than that, the inner
# dimension is split (MLPerf's fc1 at batch 1: 128 outputs, 32,768 terms each).
TARGET_THREADS = 1 << 16
MIN_CHUNK = 64


def chunk_for(inner: int, outputs: int, samples: int) -> int:
    """Terms each partial sum adds: the whole ``inner`` dimension, or a chunk of it when
    ``outputs`` times the sample tiles give fewer than :data:`TARGET_THREADS` threads.
    A function of the shapes alone, so the summation order (and the bits) does not
    depend on the device."""
    tiles = max(1, -(-samples // TILE))
    splits = min(-(-inner // MIN_CHUNK), -(-TARGET_THREADS // max(1, outputs * tiles)))
    return max(1, -(-inner // max(1, splits)))


def splits_for(inner: int, chunk: int) -> int:
    """Partial sums per output (1: no second launch)."""
    return max(1, -(-inner // chunk))


def _check(a: Any, b: Any, bias: Any, outputs: int, b_name: str = "weight") -> None:
    """One storage dtype, float32 or bf16, C-contiguous, the bias of ``outputs``."""
    raw.suffix(a.dtype)
    for name, array in ((b_name, b), ("bias", bias)):
        if array is not None and array.dtype != a.dtype:
            raise ValueError(f"linear kernels: the {name} is {array.dtype}, the activations "
                             f"{a.dtype}; pass it in the activations' dtype")
    if bias is not None and bias.shape != (outputs,):
        raise ValueError(f"linear kernels: bias of shape {bias.shape}, expected ({outputs},)")
    if not all(v.flags.c_contiguous for v in (a, b, bias) if v is not None):
        raise ValueError("linear kernels take C-contiguous arrays")


def _products(a: Any, b: Any, bias: Any, outputs: int, b_out: int, b_in: int,
              launch: Launch | None) -> Any:
    """``a @ B + bias`` with ``B[j, k] = b[j * b_out + k * b_in]``: one or two launches."""
    xp = array_module(a)
    samples, inner = (int(v) for v in a.shape)
    y = xp.empty((samples, outputs), dtype=a.dtype)
    chunk = chunk_for(inner, outputs, samples)
    splits = splits_for(inner, chunk)
    part = xp.empty((splits, samples, outputs), dtype=np.float32) if splits > 1 else None
    kind = raw.suffix(a.dtype)
    tiles = max(1, -(-samples // TILE))
    go = launch or raw.cupy_launch
    go(f"linear_partial_{kind}", splits * tiles * outputs,
       (a, b, None if part is not None else bias, None if part is not None else y, part,
        samples, outputs, inner, b_out, b_in, chunk, splits))
    if part is not None:
        go(f"linear_reduce_{kind}", samples * outputs,
           (part, bias, y, splits, samples, outputs))
    return y


def forward(x: Any, weight: Any, bias: Any = None, launch: Launch | None = None) -> Any:
    """``x @ weight.T + bias``: x (N, K), weight (O, K), bias (O,) or None -> (N, O)."""
    outputs, inner = weight.shape
    if x.ndim != 2 or x.shape[1] != inner:
        raise ValueError(f"linear forward: input {x.shape} against weight {weight.shape}")
    _check(x, weight, bias, outputs)
    return _products(x, weight, bias, int(outputs), int(inner), 1, launch)


def backward_data(dy: Any, weight: Any, launch: Launch | None = None) -> Any:
    """``dy @ weight``: dy (N, O), weight (O, I) -> (N, I)."""
    outputs, inputs = weight.shape
    if dy.ndim != 2 or dy.shape[1] != outputs:
        raise ValueError(f"linear backward: gradient {dy.shape} against weight {weight.shape}")
    _check(dy, weight, None, int(inputs))
    return _products(dy, weight, None, int(inputs), 1, int(inputs), launch)


def backward_weight(x: Any, dy: Any, bias: bool = True, launch: Launch | None = None
                    ) -> tuple[Any, Any]:
    """``(dy.T @ x, dy.sum(axis=0))`` in float32 (the bias gradient None without
    ``bias``), in one launch: x (N, I), dy (N, O) -> (O, I), (O,)."""
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"linear weight gradient: input {x.shape} against gradient {dy.shape}")
    _check(x, dy, None, 0, "gradient")
    xp = array_module(x)
    samples, inputs = (int(v) for v in x.shape)
    outputs = int(dy.shape[1])
    dw = xp.empty((outputs, inputs), dtype=np.float32)
    db = xp.empty(outputs, dtype=np.float32) if bias else None
    (launch or raw.cupy_launch)(f"linear_wgrad_{raw.suffix(x.dtype)}",
                                outputs * inputs + (outputs if bias else 0),
                                (x, dy, dw, db, samples, outputs, inputs))
    return dw, db
