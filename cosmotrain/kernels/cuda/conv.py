"""GPU 3D convolutions: the entry points :mod:`cosmotrain.kernels.conv3d` dispatches cupy
arrays to.

Same semantics as the CPU kernels: NCDHW arrays, weights ``(F, C, kD, kH, kW)``
(cross-correlation), stride an int or a triple, padding one ``(lo, hi)`` pair per spatial
dimension (asymmetric allowed), shapes validated by
:class:`cosmotrain.kernels.geometry.ConvGeometry` (``ValueError`` naming the argument).

Storage dtype: that of x (forward, wgrad) or dy (dgrad): float32 or bfloat16
(``ml_dtypes.bfloat16``); the other operand is cast to it, so the engine may pass fp32
master weights with bf16 activations (a small copy per call) or keep a bf16 copy.
Outputs are in the storage dtype: with bf16 storage dx and dW are bf16 (what cuDNN writes
for bf16 io, and what PyTorch autocast returns); accumulation is fp32 in every case.

Settings: every entry point takes ``settings`` (a :class:`~.settings.ConvSettings`, the
one its layer was built with from the job's runtime; None: the defaults).  Algorithm:
``cudnn`` (:mod:`.conv_cudnn`), ``gemm`` (:mod:`.conv_gemm`) or ``auto``, resolved on the
first cupy call that requests it and logged once with the reason.  A call cuDNN has no
engine for runs on the gemm path (logged once per shape).  numpy inputs always take the
gemm path (it is the tested CPU implementation of the same contract).

Per process, on purpose (they belong to the CUDA context, not to a job): the cuDNN runner
(one handle per device, the graph cache, bounded by the calling settings'
``graph_cache_size``), the resolved algorithm of each requested one (whether cuDNN is
usable does not change within a process) and the set of fallbacks already logged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.geometry import PaddingLike

from cosmotrain.kernels.cuda import conv1, conv_cudnn, conv_gemm
from cosmotrain.kernels.cuda.settings import ConvSettings, resolve_settings

LOG = logging.getLogger("cosmotrain.kernels.cuda")

_resolved: Dict[str, Tuple[str, str]] = {}  # requested algorithm -> (algorithm, why)
_runner: Optional[conv_cudnn.CudnnRunner] = None
_fallbacks_logged: set = set()


def default_runner() -> conv_cudnn.CudnnRunner:
    """The process's cuDNN runner (handles and graph cache), created on first use."""
    global _runner
    if _runner is None:
        _runner = conv_cudnn.CudnnRunner()
    return _runner


def cudnn_status() -> Tuple[bool, str]:
    """``(usable, why)``: whether cuDNN can serve cupy convolutions in this process."""
    try:
        import cudnn  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, (f"import cudnn failed ({type(exc).__name__}: {exc}); install "
                       "nvidia-cudnn-frontend and nvidia-cudnn-cu12 (or -cu13)")
    try:
        import cupy  # type: ignore[import-not-found]

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device visible to cupy ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device visible to cupy"
    try:
        default_runner().handle(cupy.cuda.Device().id)
        version = cudnn.backend_version_string()
    except Exception as exc:
        return False, f"a cuDNN handle could not be created ({type(exc).__name__}: {exc})"
    return True, f"cuDNN {version} through cudnn-frontend {cudnn.__version__}"


def resolve_algorithm(requested: str, probe: Callable[[], Tuple[bool, str]] = cudnn_status
                      ) -> Tuple[str, str]:
    """``(cudnn | gemm, reason)`` for the requested ``cudnn``, ``gemm`` or ``auto``.

    ``cudnn`` requested but unusable is an error (the job asked for it explicitly);
    ``auto`` falls back to gemm and says why.
    """
    if requested == "gemm":
        return "gemm", "ConvSettings.algorithm is 'gemm'"
    usable, why = probe()
    if usable:
        return "cudnn", why
    if requested == "cudnn":
        raise RuntimeError(f"ConvSettings.algorithm is 'cudnn' but {why}; use 'auto' or 'gemm'")
    return "gemm", f"cuDNN unavailable: {why}"


def algorithm(settings: Optional[ConvSettings] = None) -> Tuple[str, str]:
    """The algorithm serving cupy arrays under ``settings`` (None: the defaults) and why,
    resolved once per requested algorithm in this process (and logged then)."""
    requested = resolve_settings(settings).algorithm
    found = _resolved.get(requested)
    if found is None:
        found = _resolved[requested] = resolve_algorithm(requested, cudnn_status)
        fell_back = requested == "auto" and found[0] == "gemm"
        LOG.log(logging.WARNING if fell_back else logging.INFO,
                "GPU convolutions: %s (%s)", *found)
    return found


def _uses_cudnn(settings: ConvSettings, *arrays: Any) -> bool:
    return array_module(*arrays) is not np and algorithm(settings)[0] == "cudnn"


def _note_fallback(exc: conv_cudnn.CudnnUnsupported) -> None:
    message = str(exc)
    if message not in _fallbacks_logged:
        _fallbacks_logged.add(message)
        LOG.warning("%s; this convolution runs on the gemm path", message)


def _dispatch(op: str, operands: Tuple[Any, Any], *args: Any,
              settings: Optional[ConvSettings]) -> Any:
    """Run ``op`` (a function name both backends share) on cuDNN when ``settings`` select
    it for these operands, else, or when cuDNN has no engine for the call, on the gemm
    path; on operands padded with zero channels where ``settings.conv1_channels_pad``
    says so, conv1's weight gradient on our direct kernel where
    ``settings.conv1_algorithm`` does (:mod:`.conv1`)."""
    settings = resolve_settings(settings)
    if op == "conv3d_backward_filter" and conv1.takes_direct_wgrad(operands[0], args[0],
                                                                   args[1], settings):
        return conv1.direct_weight_grad(*operands, args[0], args[2])
    padded = conv1.run_padded(op, operands, args, settings,
                              lambda o, oa, a: _run(o, oa, *a, settings=settings))
    return _run(op, operands, *args, settings=settings) if padded is None else padded


def _run(op: str, operands: Tuple[Any, Any], *args: Any, settings: ConvSettings) -> Any:
    """:func:`_dispatch` on operands as given."""
    if _uses_cudnn(settings, *operands):
        try:
            return getattr(conv_cudnn, op)(*operands, *args, runner=default_runner(),
                                           math=settings.math,
                                           layout=settings.cudnn_layout,
                                           cache_size=settings.graph_cache_size,
                                           cudnn_autotune=settings.cudnn_autotune)
        except conv_cudnn.CudnnUnsupported as exc:
            _note_fallback(exc)
    return getattr(conv_gemm, op)(*operands, *args, settings=settings)


def conv3d_forward(x: Any, w: Any, stride: "int | Sequence[int]" = 1,
                   padding: PaddingLike = 0, *, settings: Optional[ConvSettings] = None) -> Any:
    """``y = conv3d(x, w)``: x (N,C,D,H,W), w (F,C,kD,kH,kW) -> y (N,F,Do,Ho,Wo)."""
    return _dispatch("conv3d_forward", (x, w), stride, padding, settings=settings)


def conv3d_backward_data(dy: Any, w: Any, x_shape: Sequence[int],
                         stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                         settings: Optional[ConvSettings] = None) -> Any:
    """``dL/dx`` (shape ``x_shape``) from the output gradient dy and the weights."""
    return _dispatch("conv3d_backward_data", (dy, w), x_shape, stride, padding,
                     settings=settings)


def conv3d_backward_filter(x: Any, dy: Any, w_shape: Sequence[int],
                           stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                           settings: Optional[ConvSettings] = None) -> Any:
    """``dL/dw`` (shape ``w_shape``) from the input x and the output gradient dy."""
    return _dispatch("conv3d_backward_filter", (x, dy), w_shape, stride, padding,
                     settings=settings)
