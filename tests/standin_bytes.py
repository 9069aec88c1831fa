"""How many bytes a launch of the stand-in cupy (tests/standin.py) reads and writes.

Why: issue 35's byte budget compares the bytes a GPU step's launches move with the
step's compulsory traffic (tests/compulsory_traffic.py, docs/PERFORMANCE.md "GPU:
compulsory traffic").  The counts are of operands, not of caches: a launch reads each
array operand whole and writes each result whole, what a kernel that streams its
operands once through HBM does.  The rules:

* array operations (ufuncs, numpy functions): read their array arguments (``out=``
  excepted), write their results; ``empty`` moves nothing (an allocation, no kernel),
  nor does a call whose every result is a view of an operand (``reshape``, ``astype`` /
  ``ascontiguousarray`` that change nothing);
* the project's fused cupy kernels (kernels/cuda/fused.py, which pass their output
  positionally, in place): read each distinct array argument once, write their results;
* ``__setitem__``: reads the value, writes the selected part of the target;
* our raw kernels (kernels/cuda/src/*.cu): each array argument by its parameter in the
  source, a ``const`` pointer read, any other written; the multi-tensor optimizers
  read every role of every tensor (data, gradient, state) and write all but the
  gradient;
* convolutions under :func:`cudnn_convolutions`: one launch each, reading its two
  operands and writing its result, as a cuDNN call does (the stand-in computes them
  by im2col + GEMM, whose column matrices a cuDNN engine never writes to memory).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from standin_ledger import (Launch, Ledger, addresses_of, array_bytes, describe, flat,
                            plain_arrays)

from cosmotrain.kernels.cuda import conv_gemm, raw

ALLOCATIONS = frozenset({"empty", "empty_like"})
MULTI_TENSOR = frozenset({"sgd_momentum_multi", "adam_multi"})
KERNEL_PREFIX = "cosmotrain_"  # the project's ElementwiseKernel / ReductionKernel names
CONVOLUTIONS = ("conv3d_forward", "conv3d_backward_data", "conv3d_backward_filter")


def operand_traffic(name: str, args: tuple, kwargs: dict, outputs: tuple) -> tuple[int, int]:
    """(bytes read, bytes written) of an array operation on plain ndarrays."""
    if name in ALLOCATIONS:
        return 0, 0
    out = kwargs.get("out")
    inputs = (args, tuple(v for k, v in kwargs.items() if k != "out"))
    arrays, results = _arrays(inputs), _arrays(outputs)
    if name.startswith(KERNEL_PREFIX):  # in place: the output is also an argument
        distinct = {(a.__array_interface__["data"][0], a.nbytes): a.nbytes for a in arrays}
        return sum(distinct.values()), array_bytes(outputs)
    if out is None and results and all(
            any(np.may_share_memory(r, a) for a in arrays) for r in results):
        return 0, 0  # a view or the operand itself: nothing moves
    return array_bytes(inputs), array_bytes(outputs)


def _arrays(values: Any) -> list[np.ndarray]:
    return [v for v in flat(values) if isinstance(v, np.ndarray)]


@functools.cache
def kernel_parameters() -> dict[str, tuple[bool, ...]]:
    """Each raw kernel's parameters, in order: whether each is a pointer written through
    (a pointer not declared ``const``); read from the ``.cu`` sources."""
    found: dict[str, tuple[bool, ...]] = {}
    both = re.compile(r"COSMO_BOTH\(\s*(\w+)\s*,\s*\(([^)]*)\)")
    plain = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')
    for source in raw.sources():
        text = source.read_text()
        for name, params in both.findall(text):
            for kind in ("f32", "bf16"):
                found[f"{name}_{kind}"] = _written(params)
        for name, params in plain.findall(text):
            found[name] = _written(params)
    return found


def _written(params: str) -> tuple[bool, ...]:
    return tuple("*" in p and not p.strip().startswith("const") for p in params.split(","))


def raw_traffic(kernel: str, args: tuple) -> tuple[int, int]:
    """(bytes read, bytes written) of one of our raw kernels on plain arguments."""
    if kernel in MULTI_TENSOR:
        pointers, offsets, tensors = args[0], args[1], int(args[2])
        roles = pointers.size // tensors
        total = int(offsets[-1]) * np.dtype(np.float32).itemsize
        return total * roles + array_bytes(args), total * (roles - 1)
    read = written = 0
    for is_written, value in zip(kernel_parameters()[kernel], args, strict=True):
        if isinstance(value, np.ndarray):
            if is_written:
                written += value.nbytes
            else:
                read += value.nbytes
    return read, written


def cudnn_convolutions(monkeypatch: Any, ledger: Ledger) -> None:
    """Each convolution the stand-in runs recorded as one launch, as cuDNN issues it:
    operands read, result written (the GEMM path's launches inside are dropped)."""
    for op in CONVOLUTIONS:
        monkeypatch.setattr(conv_gemm, op, _as_one_launch(op, getattr(conv_gemm, op),
                                                          ledger))


def _as_one_launch(op: str, original: Callable, ledger: Ledger) -> Callable:
    def convolution(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        start = len(ledger.launches)
        result = original(a, b, *args, **kwargs)
        del ledger.launches[start:]  # the im2col slabs, column matrices and GEMMs
        plain = plain_arrays((a, b, result))
        if b.dtype != a.dtype:  # conv_cudnn casts the other operand to a's dtype
            cast = np.empty(b.shape, a.dtype)
            ledger.launches.append(Launch(f"cudnn.{op}.cast", describe(plain[1:2]),
                                          addresses_of(plain[1:2]), plain[1].nbytes,
                                          cast.nbytes))
        read = plain[0].nbytes + plain[1].size * plain[0].itemsize
        ledger.launches.append(Launch(f"cudnn.{op}", describe(plain), addresses_of(plain),
                                      read, plain[2].nbytes))
        return result
    return convolution
