"""Settings of the GPU convolution kernels, and cuBLAS math control.

:func:`settings_for` derives a job's :class:`ConvSettings` from its
:class:`~cosmotrain.device.select.Device` (the requested algorithm, and TF32 or strict fp32
math for fp32 storage).  The settings are a value, never process state: the job's
:class:`~cosmotrain.runtime.job_runtime.Runtime` holds them (``Runtime.conv``), the layer builders
hand them to the convolution and linear layers they build, and those pass them to every
kernel call (``settings=``; None means the defaults ``ConvSettings()``, and the CPU
kernels ignore them).  Two layers built from two runtimes therefore compute under their
own settings in one process (a benchmark compares algorithms by building, or calling,
with different values).

What stays per process, on purpose, is what belongs to the CUDA context rather than to a
job: :mod:`.conv` keeps the cuDNN handles and graph cache and the resolved ``auto``
algorithm (keyed by the requested algorithm), and this module the one-time warning below.

:func:`cublas_math` switches cupy's cuBLAS compute type for float32 around a block.  CuPy
reads ``CUPY_TF32=1`` only on its first GEMM; at run time the switch is
``cupy._core._routines_linalg.set_compute_type(float32, COMPUTE_TYPE_TF32)`` (a private
but long-standing CuPy function, present in CuPy 14.2).  Where it is missing the block runs
in CuPy's own mode and one warning says so.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np

from cosmotrain.config.schema import CONV1_ALGORITHMS

if TYPE_CHECKING:
    from cosmotrain.device.select import Device

LOG = logging.getLogger("cosmotrain.kernels.cuda")

ALGORITHMS = ("cudnn", "gemm", "auto")
MATH_MODES = ("fp32", "tf32")
LAYOUTS = ("ndhwc", "ncdhw")
DENSE = ("cublas", "kernels")
DEFAULT_GEMM_BUDGET = 256 << 20
DEFAULT_GRAPH_CACHE_SIZE = 256


@dataclass(frozen=True)
class ConvSettings:
    """How cupy convolutions are computed.

    ``algorithm``: ``cudnn`` (cuDNN Frontend graphs), ``gemm`` (im2col + cupy.matmul),
    ``auto`` (cuDNN when ``import cudnn`` works and a handle can be created, else gemm).
    ``math``: ``fp32`` (no TF32 anywhere) or ``tf32`` (TF32 tensor cores for fp32
    storage; bf16 storage always multiplies on tensor cores and accumulates in fp32).
    ``cudnn_layout``: memory layout handed to cuDNN, ``ndhwc`` (transpose copies at the
    boundary; the layout of cuDNN's tensor-core kernels) or ``ncdhw`` (the engine's
    arrays described as they are, no copies).  ``ncdhw`` by measurement: on an H200 a bf16
    CosmoFlow step's convolutions took 16.5 ms in it against 20.0 ms in ``ndhwc``
    (``benchmarks/bench_gpu.py``, batch 8, 2026-11-27).
    ``cudnn_autotune``: ``device.cudnn_autotune``, under the same name down to the
    kernel: every cuDNN plan timed at a graph's first call and the fastest kept (False:
    cuDNN's first heuristic plan).
    ``dense``: how linear layers compute on a device: ``cublas`` (cupy's matmul, under
    ``math``) or ``kernels`` (our own, ``kernels/cuda/src/linear.cu``: strict float32
    arithmetic whatever ``math`` says, bf16 read as stored).  ``kernels`` is what a
    CUDA graph can capture (cupy refuses cuBLAS during capture); ``cublas`` stays the
    default until the kernels are timed on a device (``gpu_check.sh bench-dense``).
    ``gemm_budget_bytes``: bound on one GEMM's column matrix and output (bytes).
    ``graph_cache_size``: built cuDNN graphs kept (least recently used evicted).
    ``conv1_channels_pad``: ``device.conv1_channels_pad``: a forward or weight gradient
    whose input channels are not a multiple of it runs on operands padded with zero
    channels up to one (0: never), for cuDNN's tensor-core engines (:mod:`.conv1`).
    ``conv1_algorithm``: ``device.conv1_algorithm``: ``direct`` sends the forward (with
    its bias + LeakyReLU epilogue fused) and the weight gradient of a convolution with
    at most 8 input channels at stride 1 (conv1) to our kernels
    (``src/conv_direct.cu``); ``default``: the ``algorithm`` above, as every other
    convolution.
    """

    algorithm: str = "auto"
    math: str = "fp32"
    cudnn_layout: str = "ncdhw"
    cudnn_autotune: bool = False
    dense: str = "cublas"
    gemm_budget_bytes: int = DEFAULT_GEMM_BUDGET
    graph_cache_size: int = DEFAULT_GRAPH_CACHE_SIZE
    conv1_channels_pad: int = 0
    conv1_algorithm: str = "default"

    def __post_init__(self) -> None:
        for name, allowed in (("algorithm", ALGORITHMS), ("math", MATH_MODES),
                              ("cudnn_layout", LAYOUTS), ("dense", DENSE),
                              ("conv1_algorithm", CONV1_ALGORITHMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ConvSettings.{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
        if not isinstance(self.cudnn_autotune, bool):
            raise ValueError(f"ConvSettings.cudnn_autotune must be True or False, "
                             f"got {self.cudnn_autotune!r}")
        for name in ("gemm_budget_bytes", "graph_cache_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ConvSettings.{name} must be a positive int, got {value!r}")
        pad = self.conv1_channels_pad
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ValueError(f"ConvSettings.conv1_channels_pad must be an int >= 0, "
                             f"got {pad!r}")


def settings_for(device: Device) -> ConvSettings:
    """The convolution settings of a job on ``device``: its ``device.conv_algorithm``,
    TF32 math under ``precision: tf32`` (strict fp32 otherwise; bf16 storage always
    multiplies on tensor cores), and cuDNN plan autotuning under
    ``device.cudnn_autotune``; conv1's ``device.conv1_channels_pad`` and
    ``device.conv1_algorithm`` under the same names."""
    return ConvSettings(algorithm=device.conv_algorithm,
                        math="tf32" if device.precision == "tf32" else "fp32",
                        cudnn_autotune=device.cudnn_autotune,
                        conv1_channels_pad=device.conv1_channels_pad,
                        conv1_algorithm=device.conv1_algorithm)


DEFAULT_SETTINGS = ConvSettings()


def resolve_settings(settings: Optional[ConvSettings]) -> ConvSettings:
    """``settings``, or the defaults when None (what a kernel called without any uses)."""
    if settings is None:
        return DEFAULT_SETTINGS
    if not isinstance(settings, ConvSettings):
        raise TypeError(f"settings must be a ConvSettings, got {type(settings).__name__}")
    return settings


def _cupy_linalg() -> Optional[ModuleType]:
    """CuPy's GEMM module holding the per-dtype compute type, or None where absent."""
    try:
        from cupy._core import _routines_linalg  # type: ignore[import-not-found]
    except ImportError:
        return None
    needed = ("get_compute_type", "set_compute_type", "COMPUTE_TYPE_TF32",
              "COMPUTE_TYPE_DEFAULT")
    return _routines_linalg if all(hasattr(_routines_linalg, n) for n in needed) else None


_warned_no_switch = False


@contextmanager
def cublas_math(xp: Any, tf32: bool) -> Iterator[None]:
    """Run the block with cupy's float32 GEMMs in TF32 (``tf32``) or default fp32 math.

    A no-op for numpy; TF32 is requested only on devices that have it (sm >= 80).  The
    previous compute type is restored afterwards, so this composes with whatever the rest
    of the engine (linear layers) configured.
    """
    if xp is np:
        yield
        return
    linalg = _cupy_linalg()
    if linalg is None:
        _warn_no_switch()
        yield
        return
    tf32 = tf32 and _has_tf32(xp)
    want = linalg.COMPUTE_TYPE_TF32 if tf32 else linalg.COMPUTE_TYPE_DEFAULT
    before = linalg.get_compute_type(np.float32)
    if before == want:
        yield
        return
    linalg.set_compute_type(np.float32, want)
    try:
        yield
    finally:
        linalg.set_compute_type(np.float32, before)


def _has_tf32(xp: Any) -> bool:
    """Whether the current device has TF32 tensor cores (compute capability >= 8.0);
    asking cupy for TF32 elsewhere only warns, on every call."""
    return int(xp.cuda.Device().compute_capability) >= 80


def _warn_no_switch() -> None:
    global _warned_no_switch
    if not _warned_no_switch:
        _warned_no_switch = True
        LOG.warning("this CuPy has no cupy._core._routines_linalg.set_compute_type: the gemm "
                    "convolutions run in CuPy's own math mode (set CUPY_TF32=1 before "
                    "importing cupy for TF32)")
