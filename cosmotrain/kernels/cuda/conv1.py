"""conv1 on a device: its input channels padded for cuDNN's tensor-core engines, and our
direct kernel for its forward (issue 35 item 5; docs/GPU_KERNELS.md, "conv1").

conv1 (4 input channels at the full volume) takes about 62% of the convolution time on
an H200 and runs at about 1% of its peak under cuDNN (docs/PERFORMANCE.md, "GPU").  Two
remedies, each a setting of the job's :class:`~.settings.ConvSettings`:

* ``conv1_channels_pad`` (``device.conv1_channels_pad``): a forward or weight gradient
  whose input channels are not a multiple of it runs on operands padded with zero
  channels up to one (8 is what cuDNN's tensor-core engines want), whatever the
  algorithm (:mod:`.conv` pads before it dispatches, so the gemm path, which the CPU
  tests run, pads too).  The function is the same: the zero channels add exact zeros to
  every output, and the padded channels' weight gradient, which is dropped, is the only
  thing computed in vain; the bits are the same within float32 rounding (a library
  groups its sums by the reduction's length).  The data gradient is
  never padded (conv1 has none; another layer's is the unpadded one).  Costs: the padded
  input is a new array every call (written once: the copy of x and the zero channels; in
  the forward and again in the weight gradient, which must not keep it between them);
  the padded weight is **persistent**, one buffer per shape, dtype and device whose zero
  channels are written when it is made and whose real channels are copied in at each
  call (F x C x 27 values, one small launch, no allocation, the same address every step,
  as a captured CUDA graph needs).  Padding the master weight itself (the optimizer
  updating a padded array) would save that copy but change the checkpoint's layout.
* ``conv1_algorithm`` (``device.conv1_algorithm``): ``direct`` sends the forward of a
  convolution with at most :data:`DIRECT_MAX_CHANNELS` input channels at stride 1 to
  ``src/conv_direct.cu`` (:func:`.raw_ops.conv_direct_forward`), with the bias and the
  following LeakyReLU applied in the same kernel (the front door,
  ``kernels/conv3d.py``, asks), and its weight gradient (kernels at most 3 wide) to the
  same file's launches (:func:`.raw_ops.conv_direct_weight_grad`; :mod:`.conv`
  asks); the bias gradient and a fused activation's backward stay the front door's.

In the networks here only conv1 has fewer than 8 input channels, hence the names.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cuda import raw_ops
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.kernels.geometry import PaddingLike, normalize_triple

DIRECT_MAX_CHANNELS = 8
STORAGE = ("float32", "bfloat16")

# Padded weight buffers by (array module, device, shape, dtype): per process, like the
# CUDA context they live in (raw_ops keeps its constants the same way).
_PADDED_WEIGHTS: dict[tuple, Any] = {}


def padded_channels(channels: int, multiple: int) -> int:
    """``channels`` rounded up to a multiple of ``multiple`` (0: unchanged)."""
    return -(-channels // multiple) * multiple if multiple > 0 else channels


def pad_input(x: Any, channels: int) -> Any:
    """x (N, C, ...) as a new array with ``channels - C`` zero channels after its own."""
    out = array_module(x).empty((x.shape[0], channels) + tuple(x.shape[2:]), dtype=x.dtype)
    out[:, :x.shape[1]] = x
    out[:, x.shape[1]:] = 0
    return out


def pad_weight(w: Any, channels: int) -> Any:
    """w (F, C, ...) in the persistent buffer of its padded shape: zero channels written
    once, when the buffer is made; the real ones copied in now."""
    xp = array_module(w)
    shape = (w.shape[0], channels) + tuple(w.shape[2:])
    device = xp.cuda.Device().id if xp is not np else None
    key = (xp.__name__, device, shape, np.dtype(w.dtype).str)
    buffer = _PADDED_WEIGHTS.get(key)
    if buffer is None:
        buffer = _PADDED_WEIGHTS[key] = xp.zeros(shape, dtype=w.dtype)
    buffer[:, :w.shape[1]] = w
    return buffer


Run = Callable[[str, tuple, tuple], Any]


def run_padded(op: str, operands: tuple, args: tuple, settings: ConvSettings,
               run: Run) -> Optional[Any]:
    """``run(op, operands, args)`` on channel-padded operands when ``settings`` pad this
    call (a forward or a weight gradient), with the weight gradient cropped back; None
    when they do not (the caller runs it as it is)."""
    if op == "conv3d_backward_data":
        return None
    channels = int(operands[0].shape[1])
    padded = padded_channels(channels, settings.conv1_channels_pad)
    if padded == channels:
        return None
    x = pad_input(operands[0], padded)
    if op == "conv3d_forward":
        return run(op, (x, pad_weight(operands[1], padded)), args)
    w_shape, rest = tuple(args[0]), args[1:]
    dw = run(op, (x, operands[1]), ((w_shape[0], padded) + w_shape[2:], *rest))
    return array_module(dw).ascontiguousarray(dw[:, :channels])


def takes_direct(x: Any, w_shape: Sequence[int], stride: "int | Sequence[int]",
                 settings: Optional[ConvSettings]) -> bool:
    """Whether ``settings`` send this forward to the direct kernel, which takes it:
    stride 1, at most 8 input channels, its weights within the kernel's shared memory,
    float32 or bf16 storage."""
    return (settings is not None and settings.conv1_algorithm == "direct"
            and normalize_triple(stride, "stride") == (1, 1, 1)
            and x.ndim == 5 and x.shape[1] <= DIRECT_MAX_CHANNELS
            and raw_ops.direct_weights(w_shape) <= raw_ops.DIRECT_MAX_WEIGHTS
            and np.dtype(x.dtype).name in STORAGE)


def takes_direct_wgrad(x: Any, w_shape: Sequence[int], stride: "int | Sequence[int]",
                       settings: Optional[ConvSettings]) -> bool:
    """Whether ``settings`` send this weight gradient of device arrays to the direct
    kernel: as :func:`takes_direct`, with kernels at most 3 wide."""
    return (array_module(x) is not np and len(w_shape) == 5
            and w_shape[4] <= raw_ops.WGRAD_MAX_KW
            and takes_direct(x, w_shape, stride, settings))


def direct_weight_grad(x: Any, dy: Any, w_shape: Sequence[int], padding: PaddingLike) -> Any:
    """``dL/dw`` in the launches of ``conv_direct.cu``; dy cast to x's storage dtype."""
    xp = array_module(x)
    if dy.dtype != x.dtype:
        dy = dy.astype(x.dtype)
    x, dy = (a if a.flags.c_contiguous else xp.ascontiguousarray(a) for a in (x, dy))
    return raw_ops.conv_direct_weight_grad(x, dy, w_shape, padding)


def direct_forward(x: Any, w: Any, padding: PaddingLike, bias: Any = None,
                   slope: Optional[float] = None) -> Any:
    """The forward, bias and LeakyReLU (``slope``; None: none) in one launch of
    ``conv_direct.cu``; w cast to x's storage dtype, the bias to float32 (a bf16 bias
    is the rounded copy of a float32 one: exact)."""
    xp = array_module(x)
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    x, w = (a if a.flags.c_contiguous else xp.ascontiguousarray(a)  # a halo block's view
            for a in (x, w))
    if bias is not None and np.dtype(bias.dtype).name != "float32":
        bias = bias.astype(np.float32)
    return raw_ops.conv_direct_forward(x, w, padding, bias, slope)
