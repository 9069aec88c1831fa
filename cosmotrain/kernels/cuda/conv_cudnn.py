"""3D convolution forward, dgrad and wgrad on cupy arrays with NVIDIA's cuDNN Frontend.

CuPy 14 dropped its cuDNN bindings; this module drives cuDNN through the cuDNN Frontend
Python API (PyPI ``nvidia-cudnn-frontend``, ``import cudnn``, with the cuDNN library from
``nvidia-cudnn-cu12`` / ``-cu13``).  One operation graph (``conv_fprop``, ``conv_dgrad``
or ``conv_wgrad``) is built per shape / stride / padding / dtype / math / layout / device
and cached (:class:`GraphCache`, least recently used evicted), then executed with raw
device pointers of cupy arrays, a workspace from cupy's memory pool, on cupy's current
stream.

Layout.  The engine's arrays are NCDHW-contiguous.  cuDNN takes any strides over the
logical NCDHW dims, but its tensor-core kernels for 3D convolutions want channels-last
(NDHWC): with NCDHW descriptors cuDNN either picks other engines or transposes
internally.  ``layout="ndhwc"`` therefore transposes each operand into a
channels-last buffer at the boundary (one copy in, one out: for CosmoFlow's conv1 32 MiB
in and 128 MiB out per sample, well under a millisecond at H100 bandwidth) and describes
them with channels-last strides (:func:`layout_strides`); ``layout="ncdhw"`` describes the
engine's arrays as they are and copies nothing.  Which is faster is measured by
``benchmarks/bench_gpu.py`` (``--layouts``): on an H200, ``ncdhw`` (now the default of
``ConvSettings.cudnn_layout``; these functions keep ``ndhwc`` for direct callers).

Padding.  The kernels' padding is asymmetric (a block with halos is padded only on the
global boundary).  cuDNN graphs are given symmetric padding ``m = min(lo, hi)`` per
dimension, and the remaining ``lo - m`` / ``hi - m`` is a zero extension of the input
(:func:`symmetric_padding`): ``conv(pad(x, (lo, hi)))`` is ``conv`` with padding ``m``
of ``x`` extended by zeros, and dx is the matching crop of the extended gradient.  In the
channels-last layout the extension costs nothing (the transpose copy writes into a
zero-bordered buffer).  Symmetric padding is what every cuDNN convolution engine takes
(the legacy descriptor API knew no other); the frontend's ``pre_padding`` /
``post_padding`` would avoid the extension in the NCDHW layout, but which engines honour
asymmetric padding is not documented.

Precision (:func:`note_filters`).  bf16 storage: io type BFLOAT16, intermediate and
compute type FLOAT (fp32 accumulation); dgrad returns dx in bf16 and wgrad dW in bf16 (the
dtype cuDNN writes for bf16 io; PyTorch autocast does the same, fp32 master weights stay
with the optimizer).  fp32 storage: io FLOAT, compute FLOAT; ``math="fp32"`` deselects
the engines with the TENSOR_CORE numerical note (TF32 for float io, as PyTorch does when
``allow_tf32`` is off), ``math="tf32"`` keeps them.  Engines that down-convert inputs or
reduce in reduced precision are always deselected: accumulation is fp32.

Plans (``cudnn_autotune=``, the config's ``device.cudnn_autotune`` under one name from
the config to here).  False runs the first plan of cuDNN's heuristics (modes A, then
FALLBACK).  On the H200 a plain fp32 step with it ran 2x slower than with the gemm
path and about 8x slower than PyTorch's with autotuned cuDNN (docs/PERFORMANCE.md, "GPU");
the plan choice is the suspect.
True builds every plan the heuristics list and, at the first call of each graph,
times each on that call's own buffers (CUDA events, one untimed run, two timed) and keeps
the fastest, as ``torch.backends.cudnn.benchmark`` does; a plan that fails is skipped.

A graph that cuDNN cannot build raises :class:`CudnnUnsupported` (remembered per key, so
it is not rebuilt); :mod:`.conv` then runs that call on the gemm path.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Protocol, Sequence, Tuple

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.kernels.cuda import cudnn_plans
from cosmotrain.kernels.cuda.cudnn_plans import (CudnnUnsupported, GraphCache,
                                                 GraphEntry, largest_workspace, plan_name)
from cosmotrain.kernels.cuda.layouts import empty_buffer, extended_shape, from_layout, to_layout
from cosmotrain.kernels.cuda.settings import DEFAULT_GRAPH_CACHE_SIZE
from cosmotrain.kernels.geometry import ConvGeometry, Padding, PaddingLike, Triple

LOG = logging.getLogger("cosmotrain.kernels.cuda")

# cuDNN data type (cudnn.data_type member) of each storage dtype.
DATA_TYPES = {"float32": "FLOAT", "bfloat16": "BFLOAT16"}
OPS = ("fprop", "dgrad", "wgrad")
# The output role of each op; the other two roles are inputs.
OUTPUT_ROLE = {"fprop": "y", "dgrad": "x", "wgrad": "w"}


@dataclass(frozen=True)
class TensorDesc:
    """Logical dims (NCDHW or F C kD kH kW) and element strides of one graph operand."""

    dims: Tuple[int, ...]
    strides: Tuple[int, ...]


@dataclass(frozen=True)
class ConvCall:
    """Everything a cached cuDNN graph depends on (pure data, the cache key).

    ``image`` describes x *extended* by ``extend`` zeros; ``padding`` is symmetric.
    """

    op: str
    image: TensorDesc
    filter: TensorDesc
    output: TensorDesc
    padding: Triple
    stride: Triple
    dtype: str
    math: str
    layout: str
    extend: Padding
    cudnn_autotune: bool = False  # every plan timed: see :func:`build_graph`

    def key(self) -> tuple:
        return (self.op, self.image, self.filter, self.output, self.padding, self.stride,
                self.dtype, self.math, self.layout, self.cudnn_autotune)


def symmetric_padding(padding: Padding) -> Tuple[Triple, Padding]:
    """``(m, extend)``: symmetric padding ``m = min(lo, hi)`` per dimension and the zero
    extension ``(lo - m, hi - m)`` of the input that makes up the rest."""
    sym = tuple(min(lo, hi) for lo, hi in padding)
    extend = tuple((lo - m, hi - m) for (lo, hi), m in zip(padding, sym))
    return sym, extend  # type: ignore[return-value]


def layout_strides(dims: Sequence[int], layout: str) -> Tuple[int, ...]:
    """Element strides over the logical dims ``(N, C, D, H, W)`` for a buffer stored in
    ``layout``: ``ndhwc`` (channels-last, C innermost) or ``ncdhw`` (row-major)."""
    n, c, d, h, w = dims
    if layout == "ndhwc":
        return (d * h * w * c, 1, h * w * c, w * c, c)
    if layout == "ncdhw":
        return (c * d * h * w, d * h * w, h * w, w, 1)
    raise ValueError(f"layout must be ndhwc or ncdhw, got {layout!r}")


def describe(dims: Sequence[int], layout: str) -> TensorDesc:
    dims = tuple(int(v) for v in dims)
    return TensorDesc(dims, layout_strides(dims, layout))


def plan_call(op: str, geo: ConvGeometry, dtype: str, math: str, layout: str,
              cudnn_autotune: bool = False) -> ConvCall:
    """The :class:`ConvCall` of convolution ``geo`` for ``op`` (fprop, dgrad, wgrad)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in DATA_TYPES:
        raise ValueError(f"cuDNN convolutions take float32 or bfloat16 storage, got {dtype}")
    if not isinstance(cudnn_autotune, bool):
        raise ValueError(f"cudnn_autotune must be True or False, got {cudnn_autotune!r}")
    sym, extend = symmetric_padding(geo.padding)
    return ConvCall(op, describe(extended_shape(geo.x_shape, extend), layout),
                    describe(geo.w_shape, layout), describe(geo.y_shape, layout),
                    sym, geo.stride, dtype, math, layout, extend, cudnn_autotune)


def note_filters(call: ConvCall) -> Tuple[str, ...]:
    """Names of the ``cudnn.numerical_note`` members whose engines are deselected.

    Always: DOWN_CONVERT_INPUTS and REDUCED_PRECISION_REDUCTION (accumulation is fp32).
    Strict fp32 math on float32 storage also drops TENSOR_CORE (TF32) engines.
    """
    notes = ("DOWN_CONVERT_INPUTS", "REDUCED_PRECISION_REDUCTION")
    if call.dtype == "float32" and call.math == "fp32":
        notes += ("TENSOR_CORE",)
    return notes


# ---------------------------------------------------------------------------------------
# The graph cache and the runner that executes calls on the GPU.


class Runner(Protocol):
    def run(self, call: ConvCall, buffers: Mapping[str, Any],
            cache_size: int = DEFAULT_GRAPH_CACHE_SIZE) -> None:
        """Execute ``call`` on ``buffers`` (roles x, w, y; the op's output is written),
        keeping at most ``cache_size`` built graphs."""


def describe_graph(cudnn: Any, call: ConvCall, handle: Any) -> Tuple[Any, Dict[str, Any]]:
    """The (unbuilt) cuDNN Frontend graph of ``call`` and its tensors by role x, w, y.

    Pure graph description: no GPU is touched until :func:`build_graph`.
    """
    io = getattr(cudnn.data_type, DATA_TYPES[call.dtype])
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(name=f"cosmotrain_{call.op}", io_data_type=io,
                          intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def operand(name: str, desc: TensorDesc) -> Any:
        return graph.tensor(name=name, dim=list(desc.dims), stride=list(desc.strides),
                            data_type=io)

    conv = dict(padding=list(call.padding), stride=list(call.stride), dilation=[1, 1, 1],
                compute_data_type=f32, name=call.op)
    if call.op == "fprop":
        x, w = operand("x", call.image), operand("w", call.filter)
        y = out = graph.conv_fprop(image=x, weight=w, **conv)
        desc = call.output
    elif call.op == "dgrad":
        y, w = operand("dy", call.output), operand("w", call.filter)
        x = out = graph.conv_dgrad(loss=y, filter=w, **conv)
        desc = call.image
    else:
        x, y = operand("x", call.image), operand("dy", call.output)
        w = out = graph.conv_wgrad(image=x, loss=y, **conv)
        desc = call.filter
    out.set_output(True).set_data_type(io).set_dim(list(desc.dims)).set_stride(
        list(desc.strides))
    return graph, {"x": x, "w": w, "y": y}


def build_graph(cudnn: Any, call: ConvCall, handle: Any) -> GraphEntry:
    """Describe, filter by numerical notes, plan and build ``call``'s graph: the
    heuristics' first plan, or every plan for :meth:`CudnnRunner.run` to time
    (``call.cudnn_autotune``)."""
    graph, tensors = describe_graph(cudnn, call, handle)
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.deselect_numeric_notes([getattr(cudnn.numerical_note, name)
                                      for name in note_filters(call)])
        graph.check_support()
        if call.cudnn_autotune:
            graph.build_plans(cudnn.build_plan_policy.ALL)
            count = int(graph.get_execution_plan_count())
            return GraphEntry(graph, tensors, largest_workspace(graph, count), count)
        graph.build_plans()
    except cudnn.cudnnGraphNotSupportedError as exc:
        raise CudnnUnsupported(_unsupported(call, exc)) from exc
    return GraphEntry(graph, tensors, int(graph.get_workspace_size()))


def _unsupported(call: ConvCall, why: Any) -> str:
    return (f"cuDNN cannot run {call.op} {call.image.dims} x {call.filter.dims} stride "
            f"{call.stride} padding {call.padding} {call.dtype}/{call.math}/{call.layout}: "
            f"{why}")


class CudnnRunner:
    """Executes :class:`ConvCall`s on cupy buffers: one handle per device, bound to cupy's
    current stream before each call; graphs cached; workspace from cupy's pool.

    The workspace is freed right after the launch: cupy's pool hands that block only to
    later allocations on the same stream, which run after the convolution.  The cache's
    bound is the calling settings' ``graph_cache_size`` (``cache_size``), applied when a
    graph is added.
    """

    def __init__(self) -> None:
        self._cache = GraphCache()
        self._handles: Dict[int, Any] = {}
        self._unsupported: Dict[tuple, str] = {}
        self._lock = threading.Lock()

    @property
    def cache(self) -> GraphCache:
        return self._cache

    @property
    def unsupported(self) -> Dict[tuple, str]:
        """Keys cuDNN could not build a graph for, with the reason (a copy)."""
        return dict(self._unsupported)

    def handle(self, device: int) -> Any:
        """The cuDNN handle of ``device`` (created on first use, on that device)."""
        if device not in self._handles:
            import cudnn
            import cupy

            with cupy.cuda.Device(device):
                self._handles[device] = cudnn.create_handle()
        return self._handles[device]

    def run(self, call: ConvCall, buffers: Mapping[str, Any],
            cache_size: int = DEFAULT_GRAPH_CACHE_SIZE) -> None:
        import cudnn
        import cupy

        device = int(buffers["x"].device.id)
        key = call.key() + (device,)
        if key in self._unsupported:
            raise CudnnUnsupported(self._unsupported[key])
        with self._lock, cupy.cuda.Device(device):
            handle = self.handle(device)
            cudnn.set_stream(handle, cupy.cuda.get_current_stream().ptr)
            try:
                entry = self._cache.get(key, lambda: build_graph(cudnn, call, handle),
                                        cache_size)
            except CudnnUnsupported as exc:
                self._unsupported[key] = str(exc)
                raise
            workspace = cupy.empty(entry.workspace, dtype=cupy.uint8) if entry.workspace else None
            pointers = {entry.tensors[role]: int(buffers[role].data.ptr) for role in "xwy"}
            # a null pointer, not None, when the plan needs no workspace: the frontend
            # (1.20, seen on an H200) reads None as an object to take a DLPack pointer from
            address = 0 if workspace is None else int(workspace.data.ptr)
            if entry.needs_tuning:
                self._tune(entry, call, key, pointers, address, handle)
            if entry.plan is None:
                entry.graph.execute(pointers, address, handle=handle)
            else:
                entry.graph.execute_plan_at_index(pointers, address, entry.plan,
                                                  handle=handle)

    def _tune(self, entry: GraphEntry, call: ConvCall, key: tuple, pointers: Dict[Any, int],
              workspace: int, handle: Any) -> None:
        """Time every plan of ``entry`` on this call's own buffers and keep the fastest
        (the output is written again by the chosen plan afterwards)."""
        import cupy

        def seconds_of(index: int) -> float:
            return cudnn_plans.event_seconds(cupy, lambda: entry.graph.execute_plan_at_index(
                pointers, workspace, index, handle=handle))

        try:
            entry.plan, failures = cudnn_plans.fastest_plan(entry.candidates, seconds_of)
        except CudnnUnsupported as exc:
            self._unsupported[key] = _unsupported(call, exc)
            raise CudnnUnsupported(self._unsupported[key]) from exc
        LOG.info("cuDNN %s %s x %s %s: plan %d of %d (%s)%s", call.op, call.image.dims,
                 call.filter.dims, call.dtype, entry.plan, entry.candidates,
                 plan_name(entry.graph, entry.plan),
                 f"; {len(failures)} could not run" if failures else "")


# ---------------------------------------------------------------------------------------
# The three convolutions (NCDHW in, NCDHW out, like cosmotrain.kernels.conv3d).


def cudnn_storage(a: Any, name: str) -> np.dtype:
    """float32 or bfloat16 (the storage dtypes this module sends to cuDNN)."""
    dtype = np.dtype(a.dtype)
    if dtype.name not in DATA_TYPES:
        raise ValueError(f"{name} must be float32 or bfloat16 for cuDNN, got dtype {dtype.name}")
    return dtype


def _operands(a: Any, name: str, b: Any) -> tuple[Any, np.dtype, Any]:
    """``(xp, storage dtype of a, b cast to it)``: cuDNN computes in one storage type."""
    storage = cudnn_storage(a, name)
    return array_module(a, b), storage, b.astype(storage, copy=False)


def _run(runner: Runner, call: ConvCall, buffers: Dict[str, Any], cache_size: int
         ) -> Dict[str, Any]:
    runner.run(call, buffers, cache_size)
    return buffers


def conv3d_forward(x: Any, w: Any, stride: "int | Sequence[int]" = 1,
                   padding: PaddingLike = 0, *, runner: Runner, math: str = "fp32",
                   layout: str = "ndhwc", cache_size: int = DEFAULT_GRAPH_CACHE_SIZE,
                   cudnn_autotune: bool = False) -> Any:
    """``y = conv3d(x, w)`` in the dtype of x (w is cast to it)."""
    xp, storage, w = _operands(x, "x", w)
    geo = ConvGeometry.create(x.shape, w.shape, stride, padding)
    call = plan_call("fprop", geo, storage.name, math, layout, cudnn_autotune)
    out = _run(runner, call, {"x": to_layout(xp, x, layout, call.extend),
                              "w": to_layout(xp, w, layout),
                              "y": empty_buffer(xp, call.output.dims, layout, storage)},
               cache_size)
    return from_layout(xp, out["y"], layout)


def conv3d_backward_data(dy: Any, w: Any, x_shape: Sequence[int],
                         stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                         runner: Runner, math: str = "fp32", layout: str = "ndhwc",
                         cache_size: int = DEFAULT_GRAPH_CACHE_SIZE,
                         cudnn_autotune: bool = False) -> Any:
    """``dL/dx`` of shape ``x_shape`` in the dtype of dy (w is cast to it)."""
    xp, storage, w = _operands(dy, "dy", w)
    geo = ConvGeometry.create(x_shape, w.shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    call = plan_call("dgrad", geo, storage.name, math, layout, cudnn_autotune)
    out = _run(runner, call, {"y": to_layout(xp, dy, layout), "w": to_layout(xp, w, layout),
                              "x": empty_buffer(xp, call.image.dims, layout, storage)},
               cache_size)
    return from_layout(xp, out["x"], layout, crop=call.extend)


def conv3d_backward_filter(x: Any, dy: Any, w_shape: Sequence[int],
                           stride: "int | Sequence[int]" = 1, padding: PaddingLike = 0, *,
                           runner: Runner, math: str = "fp32", layout: str = "ndhwc",
                           cache_size: int = DEFAULT_GRAPH_CACHE_SIZE,
                           cudnn_autotune: bool = False) -> Any:
    """``dL/dw`` of shape ``w_shape`` in the dtype of x (dy is cast to it)."""
    xp, storage, dy = _operands(x, "x", dy)
    geo = ConvGeometry.create(x.shape, w_shape, stride, padding)
    geo.check("dy", dy.shape, geo.y_shape)
    call = plan_call("wgrad", geo, storage.name, math, layout, cudnn_autotune)
    out = _run(runner, call, {"x": to_layout(xp, x, layout, call.extend),
                              "y": to_layout(xp, dy, layout),
                              "w": empty_buffer(xp, call.filter.dims, layout, storage)},
               cache_size)
    return from_layout(xp, out["w"], layout)
