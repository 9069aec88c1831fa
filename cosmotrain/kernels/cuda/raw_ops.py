"""Python faces of our CUDA kernels (``src/*.cu``): each allocates what it returns,
sizes the launch and passes the arguments in the kernel's types.

``launch`` is :func:`.raw.cupy_launch` (cupy arrays, the current stream) unless a caller
hands another with its signature: the tests run these faces on numpy arrays through the
host build of the same sources (tests/cuda_host.py).  No face reads anything back from
the device, so none makes the host wait.  Arrays are C-contiguous NCDHW, float32 or
bfloat16 storage (the dtype picks the ``_f32`` / ``_bf16`` entry point).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from cosmotrain.device.xp import array_module

from cosmotrain.kernels.cuda import pool_tables, raw
from cosmotrain.kernels.geometry import ConvGeometry
from cosmotrain.kernels.leaky_factors import backward_factors

Launch = Callable[[str, int, Sequence[Any]], None]
MODES = {"log1p": 0, "mean": 1, "none": 2}


def _launch(launch: Optional[Launch]) -> Launch:
    return launch or raw.cupy_launch


# Small constant arrays (pooling tables, dropout shapes) already on a device, by
# (array module, device, dtype, values): uploaded once, so a repeated step copies
# nothing from the host (a pageable copy would make the host wait) and a captured graph
# keeps valid addresses.  Per process, like the CUDA context the arrays live in.
_CONSTANTS: dict[tuple, Any] = {}


def constant(values: Sequence[int], dtype: Any, xp: Any = np) -> Any:
    """``values`` as a read-only array of ``xp`` (cached on the device for cupy)."""
    if xp is np:
        return np.asarray(values, dtype=dtype)
    key = (xp.__name__, xp.cuda.Device().id, np.dtype(dtype).str, tuple(values))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = xp.asarray(np.asarray(values, dtype=dtype))
    return _CONSTANTS[key]


def _split(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(samples, channels, voxels per channel)`` of an N, C, ... shape."""
    return int(shape[0]), int(shape[1]), math.prod(int(v) for v in shape[2:])


def input_transform(counts: Any, dtype: Any, transform: str, channels_last: bool,
                    table: Any = None, divisor: Any = None,
                    launch: Optional[Launch] = None, out: Any = None) -> Any:
    """int16 ``counts`` (NDHWC when ``channels_last``, else NCDHW) -> NCDHW in ``dtype``.

    ``table``: the float32 log1p of every int16 (``data.transform.int16_log1p_table``,
    on the device) for ``log1p``; ``divisor``: float32, one per sample, for ``mean``;
    ``out``: the array to write (that shape and dtype), else a new one."""
    xp = array_module(counts)
    n, *rest = counts.shape
    shape = (n, rest[-1], *rest[:-1]) if channels_last else tuple(counts.shape)
    y = xp.empty(shape, dtype=dtype) if out is None else out
    if y.shape != shape or y.dtype != np.dtype(dtype):
        raise ValueError(f"input_transform writes {shape} {np.dtype(dtype)}, "
                         f"not into {y.shape} {y.dtype}")
    samples, channels, spatial = _split(shape)
    _launch(launch)(f"input_transform_{raw.suffix(dtype)}", y.size,
                    (counts, y, table, divisor, samples, channels, spatial,
                     int(channels_last), MODES[transform]))
    return y


def bias_leaky_relu(x: Any, bias: Any, slope: float, out: Any = None,
                    launch: Optional[Launch] = None) -> Any:
    """``v = x + bias[c]; out = v > 0 ? v : slope * v`` (``bias`` float32 or None; ``out``
    may be ``x``: in place)."""
    y = array_module(x).empty_like(x) if out is None else out
    samples, channels, spatial = _split(x.shape)
    _launch(launch)(f"bias_leaky_relu_{raw.suffix(x.dtype)}", x.size,
                    (x, y, bias, samples, channels, spatial, float(np.float32(slope))))
    return y


def leaky_relu_backward(dy: Any, y: Any, slope: float, out: Any = None,
                        launch: Optional[Launch] = None) -> Any:
    """``dy * (y > 0 ? up : down)`` (``out`` may be ``dy``)."""
    dx = array_module(dy).empty_like(dy) if out is None else out
    up, down = backward_factors(slope)
    _launch(launch)(f"leaky_relu_backward_{raw.suffix(dy.dtype)}", dy.size,
                    (dy, y, dx, dy.size, up, down))
    return dx


def _whole(pool: Any) -> bool:
    """The CPU kernels' summation order for this geometry (float32 itemsize: bf16 is
    pooled widened there)."""
    return bool(pool.whole(4))


def avg_pool_forward(x: Any, pool: Any, launch: Optional[Launch] = None) -> Any:
    """Average pooling (zero padding counted) in one pass: the CPU kernel's bits."""
    xp = array_module(x)
    y = xp.empty(pool.y_shape, dtype=x.dtype)
    geometry = constant(pool_tables.forward_table(pool, _whole(pool)), np.int32, xp)
    _launch(launch)(f"avgpool_forward_{raw.suffix(x.dtype)}", y.size,
                    (x, y, pool.x_shape[0] * pool.x_shape[1], geometry,
                     float(np.float32(1.0 / math.prod(pool.kernel)))))
    return y


def avg_pool_backward(dy: Any, pool: Any, activation: Any = None, slope: float = 0.0,
                      launch: Optional[Launch] = None) -> Any:
    """Gradient of :func:`avg_pool_forward` as a gather; with ``activation`` (the output
    of the LeakyReLU before the pooling, of the input's shape) times that activation's
    backward factors in the same pass.  The order is the CPU backward's, which pools
    by planes only for large volumes (``pool.by_planes`` plays no part there)."""
    xp = array_module(dy)
    dx = xp.empty(pool.x_shape, dtype=dy.dtype)
    up, down = backward_factors(slope)
    whole = _whole(type(pool)(pool.x_shape, pool.kernel, pool.stride, pool.padding))
    geometry = constant(pool_tables.backward_table(pool, whole), np.int32, xp)
    _launch(launch)(f"avgpool_backward_{raw.suffix(dy.dtype)}", dx.size,
                    (dy, dx, activation, pool.x_shape[0] * pool.x_shape[1], geometry,
                     float(np.float32(1.0 / math.prod(pool.kernel))), int(whole), up, down))
    return dx


def max_pool2_forward(x: Any, launch: Optional[Launch] = None) -> tuple[Any, Any]:
    """2x2x2 max pooling, stride 2, no padding: ``(y, argmax)`` (int8 offsets)."""
    xp = array_module(x)
    shape = x.shape[:2] + tuple(v // 2 for v in x.shape[2:])
    y, arg = xp.empty(shape, dtype=x.dtype), xp.empty(shape, dtype=np.int8)
    _launch(launch)(f"maxpool2_forward_{raw.suffix(x.dtype)}", y.size,
                    (x, y, arg, x.shape[0] * x.shape[1], *x.shape[2:]))
    return y, arg


def max_pool2_backward(dy: Any, argmax: Any, x_shape: Sequence[int],
                       launch: Optional[Launch] = None) -> Any:
    """Gradient of :func:`max_pool2_forward`: every input element written once."""
    dx = array_module(dy).empty(tuple(x_shape), dtype=dy.dtype)
    _launch(launch)(f"maxpool2_backward_{raw.suffix(dy.dtype)}", dx.size,
                    (dy, argmax, dx, x_shape[0] * x_shape[1], *x_shape[2:]))
    return dx


def dropout_shape(local_shape: Sequence[int], offset: Sequence[int],
                  global_shape: Sequence[int]) -> tuple[int, ...]:
    """The 15 int64 ``dropout.cu`` reads: local shape, offset, global shape, each padded
    in front to 5 dimensions."""
    pad = 5 - len(local_shape)
    if pad < 0:
        raise ValueError(f"dropout on the device takes up to 5 dimensions, not {len(local_shape)}")
    return tuple([1] * pad + list(local_shape) + [0] * pad + list(offset) + [1] * pad
                 + list(global_shape))


def dropout(x: Any, offset: Sequence[int], global_shape: Sequence[int], p: float, seed: int,
            salt: int, step: Any, launch: Optional[Launch] = None) -> Any:
    """Inverted dropout with :func:`cosmotrain.kernels.dropout.dropout_keep_mask`'s mask
    for the stream of (``seed``, the step count, ``salt``); forward, and the backward as
    the same call on the gradient.  ``step``: the step count in device memory (a float64
    array of one element, ``engine/step_scalars.py``), read by the kernel, so that a
    captured graph draws each replay's own mask."""
    xp = array_module(x)
    y = xp.empty_like(x)
    _launch(launch)(f"dropout_{raw.suffix(x.dtype)}", x.size,
                    (x, y, constant(dropout_shape(x.shape, offset, global_shape), np.int64, xp),
                     _u64(seed), _u64(salt), step, float(p),
                     float(np.float32(1.0 / (1.0 - p)))))
    return y


def _u64(value: int) -> int:
    """``value`` as the kernel's unsigned 64-bit word (``stream_key`` masks the seed so)."""
    return int(value) & (2**64 - 1)


def put_values(target: Any, values: Sequence[float], launch: Optional[Launch] = None) -> None:
    """Write up to eight ``values`` into the float64 or float32 device array ``target``
    (``scalars.cu``): one launch whose arguments carry them, no copy from the host."""
    if len(values) > 8 or len(values) > target.size:
        raise ValueError(f"put_values writes up to 8 values into {target.size}, "
                         f"not {len(values)}")
    kernel = {"float64": "put_f64x8", "float32": "put_f32x8"}[np.dtype(target.dtype).name]
    padded = [float(v) for v in values] + [0.0] * (8 - len(values))
    _launch(launch)(kernel, len(values), (target, len(values), *padded))


def mse(pred: Any, target: Any, total_count: int, total: Any, nonfinite: Any,
        launch: Optional[Launch] = None) -> Any:
    """The gradient of ``sum((pred - target)^2) / total_count``; adds the sum of squares
    into ``total`` (a float64 device scalar) and sets ``nonfinite`` (int32) to 1 when a
    difference is not finite.  Nothing is read back."""
    grad = array_module(pred).empty_like(pred)
    _launch(launch)(f"mse_{raw.suffix(pred.dtype)}", pred.size,
                    (pred, target, grad, pred.size, float(np.float32(2.0 / total_count)),
                     total, nonfinite))
    return grad


def conv_direct_forward(x: Any, w: Any, padding: Any, bias: Any = None,
                        slope: Optional[float] = None, launch: Optional[Launch] = None) -> Any:
    """``conv3d(x, w)`` at stride 1 (``padding`` as :class:`ConvGeometry` takes it), then
    ``+ bias`` (float32 or None) and LeakyReLU with ``slope`` (None: none), in one launch
    of ``conv_direct.cu``; x and w C-contiguous in one storage dtype, the weights within
    :data:`DIRECT_MAX_WEIGHTS` once padded to groups of 16 filters."""
    geo = ConvGeometry.create(x.shape, w.shape, 1, padding)
    if direct_weights(w.shape) > DIRECT_MAX_WEIGHTS:
        raise ValueError(f"conv_direct.cu holds at most {DIRECT_MAX_WEIGHTS} weights, "
                         f"not those of {tuple(w.shape)}")
    y = array_module(x).empty(geo.y_shape, dtype=x.dtype)
    groups = -(-geo.filters // FILTER_GROUP)
    _launch(launch)(f"conv_direct_forward_{raw.suffix(x.dtype)}",  # voxel pairs along W
                    geo.y_shape[0] * groups * geo.out[0] * geo.out[1] * -(-geo.out[2] // 2),
                    (x, w, bias, y, *geo.x_shape[:2], geo.filters, *geo.x_shape[2:],
                     *geo.y_shape[2:], *geo.kernel, *(lo for lo, _ in geo.padding),
                     float(np.float32(1.0 if slope is None else slope))))
    return y


def conv_direct_weight_grad(x: Any, dy: Any, w_shape: Sequence[int], padding: Any,
                            launch: Optional[Launch] = None) -> Any:
    """``dL/dw`` (shape ``w_shape``, x's storage dtype) of :func:`conv_direct_forward`
    from x and dy (C-contiguous, one storage dtype), in launches of ``conv_direct.cu``:
    float32 partial sums per chunk of output rows, sized for about
    :data:`WGRAD_THREADS` threads, then their sums in chunk order, :data:`REDUCE_FAN`
    chunks a thread, until one is left (two launches up to that many chunks)."""
    geo = ConvGeometry.create(x.shape, w_shape, 1, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    if geo.kernel[2] > WGRAD_MAX_KW:
        raise ValueError(f"conv_direct.cu's weight gradient takes kernels up to "
                         f"{WGRAD_MAX_KW} wide, not {geo.kernel[2]}")
    xp = array_module(x)
    taps = geo.channels * geo.kernel[0] * geo.kernel[1] * -(-geo.filters // FILTER_GROUP)
    rows = geo.batch * geo.out[0] * geo.out[1]
    per_chunk = max(1, -(-rows * taps // WGRAD_THREADS))
    chunks = -(-rows // per_chunk)
    partial = xp.empty((chunks, *geo.w_shape), dtype=np.float32)
    dw = xp.empty(geo.w_shape, dtype=x.dtype)
    suffix = raw.suffix(x.dtype)
    _launch(launch)(f"conv_direct_wgrad_{suffix}", chunks * taps,
                    (x, dy, partial, *geo.x_shape[:2], geo.filters, *geo.x_shape[2:],
                     *geo.out, *geo.kernel, *(lo for lo, _ in geo.padding), per_chunk,
                     chunks))
    while chunks > REDUCE_FAN:  # float32 sums of REDUCE_FAN chunks each
        groups = -(-chunks // REDUCE_FAN)
        fewer = xp.empty((groups, *geo.w_shape), dtype=np.float32)
        _launch(launch)("conv_direct_wgrad_reduce_f32", fewer.size,
                        (partial, fewer, chunks, REDUCE_FAN, dw.size))
        partial, chunks = fewer, groups
    _launch(launch)(f"conv_direct_wgrad_reduce_{suffix}", dw.size,
                    (partial, dw, chunks, chunks, dw.size))
    return dw


FILTER_GROUP = 16  # conv_direct.cu's filters per thread
DIRECT_MAX_WEIGHTS = 6912  # its shared-memory array: 8 channels x 27 taps x 32 filters
WGRAD_MAX_KW = 3  # its weight gradient's widest kernel
WGRAD_THREADS = 1 << 18  # threads its weight gradient's first launch aims at
REDUCE_FAN = 64  # partial sums one thread of its reduction adds


def direct_weights(w_shape: Sequence[int]) -> int:
    """The floats ``conv_direct.cu`` stages for weights of ``w_shape`` (filters rounded
    up to whole groups)."""
    return -(-int(w_shape[0]) // FILTER_GROUP) * FILTER_GROUP * math.prod(w_shape[1:])


@dataclass(frozen=True)
class TensorTable:
    """The address table of the multi-tensor kernels, holding the arrays it points at
    (freed arrays would leave it pointing into memory the pool hands out again)."""

    pointers: Any
    offsets: Any
    total: int
    arrays: tuple


def tensor_table(roles: Sequence[Sequence[Any]], address: Callable[[Any], int],
                 xp: Any = np, upload: Optional[Callable[[Any, np.ndarray], Any]] = None
                 ) -> TensorTable:
    """The table for the multi-tensor kernels, built once per bucket list: ``roles[r][t]``
    is role ``r`` (data, grad, then the state) of tensor ``t``, all float32 of matching
    sizes; ``address`` gives an array's device address.  ``upload(xp, host)`` puts a
    host array on the device and returns what must live as long as the table (default:
    ``xp.asarray``); the step passes a copy through pinned memory, which a graph can
    capture."""
    sizes = [a.size for a in roles[0]]
    for arrays in roles:
        if [a.size for a in arrays] != sizes or any(a.dtype != np.float32 for a in arrays):
            raise ValueError("every role needs float32 arrays of the parameters' sizes")
    pointers = np.asarray([address(a) for arrays in roles for a in arrays], dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    put = upload or (lambda xp_, host: (xp_.asarray(host),))
    (pointers_on, *keep), (offsets_on, *keep_too) = put(xp, pointers), put(xp, offsets)
    return TensorTable(pointers_on, offsets_on, int(offsets[-1]),
                       (*(a for arrays in roles for a in arrays), *keep, *keep_too))


def sgd_hyper(momentum: float, lr: float, first: bool, weight_decay: float = 0.0
              ) -> np.ndarray:
    """``sgd_momentum_multi``'s hyperparameters (copy them to the device)."""
    return np.asarray([momentum, lr, float(first), weight_decay], dtype=np.float32)


def adam_hyper(beta1: float, beta2: float, eps: float, lr: float, step: int,
               weight_decay: float = 0.0) -> np.ndarray:
    """``adam_multi``'s hyperparameters for step ``step`` (from 1), rounded as
    ``kernels.optim_update.adam`` rounds them."""
    return np.asarray([beta1, 1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2 ** step), eps,
                       lr / (1 - beta1 ** step), weight_decay], dtype=np.float32)


def multi_update(kernel: str, table: TensorTable, hyper: Any, skip: Any,
                 launch: Optional[Launch] = None) -> None:
    """One ``sgd_momentum_multi`` or ``adam_multi`` launch over a :func:`tensor_table`;
    ``hyper`` (float32 device array) and ``skip`` (int32 device flag, or None: always
    apply) stay on the device."""
    _launch(launch)(kernel, table.total, (table.pointers, table.offsets,
                                          len(table.offsets) - 1, hyper, skip))


def nonfinite_flag(x: Any, flag: Any, launch: Optional[Launch] = None) -> None:
    """Set the int32 device ``flag`` to 1 when the float32 ``x`` holds NaN or Inf."""
    _launch(launch)("nonfinite_flag", x.size, (x, x.size, flag))
