"""A stand-in for cupy that runs on the CPU and counts what a GPU step would make the
device and the host do: host synchronisations, kernel launches, allocations, uploads.

Why a test tool (here, not in ``cosmotrain/``): it exists to measure the GPU path on a
machine without one (docs/GPU.md, "What the CPU verifies"); nothing a user runs needs
it, and it runs our own CUDA kernels through the host build of tests/cuda_host.py.

How it stands in: :func:`installed` puts a :class:`StandIn` module in
``sys.modules["cupy"]`` for the duration of a ``with`` block.  ``cosmotrain.device.xp``
recognises cupy arrays by ``isinstance(a, sys.modules["cupy"].ndarray)``, so the engine's
one routing decision (:func:`cosmotrain.kernels.route.route`) sends the stand-in's
arrays down the GPU path unchanged: the CUDA front doors, cupy's
``ElementwiseKernel`` / ``ReductionKernel`` (computed here by numpy twins of the
project's fused kernels), the gemm convolutions (numpy ``matmul`` standing in for
cuBLAS; cuDNN is not importable on the CPU, so ``conv_algorithm: auto`` resolves to
gemm), and our raw kernels (``raw.cupy_launch`` replaced by the host launcher).

What counts as what:

* a **sync** is every read of device memory by the host and every wait: ``bool``,
  ``float``, ``int``, ``.item()``, ``.tolist()``, ``.get()``, ``asnumpy``, printing,
  ``synchronize`` (of a stream, an event or the device).
  One conversion goes uncounted: ``np.asarray(device_array)`` (and ``np.array``) hands
  numpy a subclass's memory without a hook; real cupy refuses it (``TypeError``:
  implicit conversion), so on a device it fails loudly instead of waiting;
* a **launch** is each array operation (ufunc, numpy function, fused or raw kernel):
  its name, the shapes and buffer addresses of its array operands and its scalar
  arguments, in order;
* an **allocation** is each new device buffer (a result that is not a view);
* an **upload** is each host -> device copy (``asarray`` of a host array, ``set``), a
  **download** each queued device -> host copy (``get(blocking=False)`` into pinned
  memory: the staging transport's, followed by the stream synchronisation it needs);
* each launch's **bytes** read and written: its operands' and results' sizes
  (tests/standin_bytes.py says how views, in-place results and raw kernels count).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from standin_bytes import operand_traffic, raw_traffic
from standin_graph import MemoryPool, Recorder, replay_of
from standin_ledger import (Launch, Ledger, addresses_of, array_bytes, describe, flat,
                            plain_arrays)
from standin_streams import Streams


class StandIn(types.ModuleType):
    """The stand-in ``cupy`` module: numpy's functions on :attr:`ndarray` arrays."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__("cupy")
        self.ledger = ledger
        self.__version__ = "standin"
        self.ndarray = _array_class(self)
        self.cuda = _cuda(ledger)
        self.graphs = Recorder(ledger, self.cuda.streams.is_pinned)
        self.cuda.streams.recorder = self.graphs
        self.cuda.MemoryPool = MemoryPool
        self.cuda.using_allocator = lambda malloc=None: self.graphs.using_allocator(malloc)
        ledger.on_sync = lambda why: self.graphs.refuse(f"a host wait ({why})")
        self._core = types.SimpleNamespace()  # no _routines_linalg: no TF32 switch
        self.ElementwiseKernel = lambda *a: _FusedKernel(self, a[-1])
        self.ReductionKernel = lambda *a: _FusedKernel(self, a[-1])

    # -- arrays in and out -------------------------------------------------------
    def wrap(self, result: Any, inputs: tuple = ()) -> Any:
        """Results as device arrays; each one whose memory is new is an allocation."""
        if isinstance(result, tuple):
            return tuple(self.wrap(r, inputs) for r in result)
        if isinstance(result, np.generic):
            result = np.asarray(result)  # cupy's reductions return 0-d arrays
        if not isinstance(result, np.ndarray):
            return result
        if not any(isinstance(i, np.ndarray) and np.shares_memory(result, i)
                   for i in flat(inputs)):
            base = result if result.base is None else result.base
            if isinstance(base, np.ndarray) and not any(
                    isinstance(i, np.ndarray) and np.shares_memory(base, i)
                    for i in flat(inputs)):
                self.ledger.allocations.append((result.shape, result.dtype.str))
                self.graphs.track(base)
        return result.view(self.ndarray) if type(result) is np.ndarray else result

    def launch(self, name: str, function: Callable, args: tuple, kwargs: dict,
               traffic: tuple[int, int] | None = None) -> Any:
        """One launch; ``traffic`` (bytes read, written) when its operands overstate it."""
        self.graphs.check_launch(name)
        plain = plain_arrays(args)
        plain_kwargs = {k: plain_arrays(v) for k, v in kwargs.items()}
        result = self.wrap(function(*plain, **plain_kwargs), (*plain, *plain_kwargs.values()))
        outputs = plain_arrays(result if isinstance(result, tuple) else (result,))
        operands = (plain, tuple(plain_kwargs.items()), outputs)
        if traffic is None:
            traffic = operand_traffic(name, plain, plain_kwargs, outputs)
        record = Launch(name, describe(operands), addresses_of(operands), *traffic)
        self.ledger.launches.append(record)
        self.graphs.record(record, replay_of(function, plain, plain_kwargs, outputs))
        return result

    def asarray(self, a: Any, dtype: Any = None, order: Any = None) -> Any:
        if isinstance(a, self.ndarray):
            if dtype is None or np.dtype(dtype) == a.dtype:
                return a
            return self.launch("astype", lambda v: v.astype(dtype), (a,), {})
        self.graphs.refuse("a copy from pageable host memory (asarray)")
        host = np.asarray(a, dtype=dtype)
        self.ledger.uploads.append((host.shape, host.dtype.str))
        self.ledger.allocations.append((host.shape, host.dtype.str))
        buffer = np.array(host)
        self.graphs.track(buffer)
        return buffer.view(self.ndarray)

    def array(self, a: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> Any:
        if not isinstance(a, self.ndarray):
            return self.asarray(a, dtype)
        if not copy and (dtype is None or np.dtype(dtype) == a.dtype):
            return a
        return self.launch("array", lambda v: np.array(v, dtype=dtype, order=order), (a,),
                           {})

    def asnumpy(self, a: Any) -> np.ndarray:
        self.ledger.sync("asnumpy")
        return np.array(plain_arrays(a))

    def get_array_module(self, *arrays: Any) -> Any:
        return self if any(isinstance(a, self.ndarray) for a in arrays) else np

    def __getattr__(self, name: str) -> Any:
        found = getattr(np, name)
        if isinstance(found, type) or not callable(found):
            return found  # dtypes, constants
        if isinstance(found, types.ModuleType):
            return found
        return lambda *args, **kwargs: self.launch(name, found, args, kwargs)


def _array_class(module: StandIn) -> type:
    """A numpy subclass whose host reads are counted and whose operations are launches."""
    ledger = module.ledger

    def read(why: str, method: str) -> Callable:
        def counted(self: np.ndarray, *args: Any, **kwargs: Any) -> Any:
            ledger.sync(why)
            return getattr(self.view(np.ndarray), method)(*args, **kwargs)
        return counted

    class DeviceArray(np.ndarray):
        __bool__ = read("bool", "__bool__")
        __float__ = read("float", "__float__")
        __int__ = read("int", "__int__")
        __index__ = read("index", "__index__")
        __complex__ = read("complex", "__complex__")
        item = read("item", "item")
        tolist = read("tolist", "tolist")
        __repr__ = read("print", "__repr__")
        __str__ = read("print", "__str__")
        __format__ = read("print", "__format__")
        __reduce__ = read("pickle", "__reduce__")

        def get(self, stream: Any = None, out: Any = None, blocking: bool = True) -> Any:
            """A blocking copy is a sync; a queued one into pinned ``out`` is not (the
            stream synchronisation that must follow before the host reads it is)."""
            if blocking:
                ledger.sync("get")
            else:
                ledger.downloads.append((self.shape, self.dtype.str))
            if out is None:
                return np.array(self.view(np.ndarray))
            np.copyto(out, self.view(np.ndarray))
            return out

        def set(self, host: Any, stream: Any = None) -> None:
            """Queued on ``stream`` (tests/standin_streams.py: it may lag)."""
            module.graphs.check_copy(host)
            ledger.uploads.append((self.shape, self.dtype.str))
            target = self.view(np.ndarray)
            (stream or module.cuda.streams.current).enqueue(
                lambda: np.copyto(target, host), target.__array_interface__["data"][0])
            module.graphs.record(Launch("memcpy.htod", describe((target,)),
                                        addresses_of((target,)), target.nbytes,
                                        target.nbytes), lambda: np.copyto(target, host))

        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            ledger.sync("__array__")
            plain = self.view(np.ndarray)
            return plain if dtype is None else plain.astype(dtype)

        def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any):
            function = ufunc if method == "__call__" else getattr(ufunc, method)
            name = ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}"
            return module.launch(name, function, inputs, kwargs)

        def __array_function__(self, function: Any, types_: Any, args: Any, kwargs: Any):
            return module.launch(function.__name__, function, args, kwargs)

        @property
        def data(self) -> Any:
            """cupy's memory pointer (``.data.ptr``), here the host address."""
            return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

        def __getitem__(self, key: Any) -> Any:
            """A view, 0-d for a single element (as cupy: no numpy scalar, no read); a
            copy (advanced indexing) is a launch."""
            plain = self.view(np.ndarray)
            found = plain[plain_arrays(key)]
            if isinstance(found, np.ndarray) and found.size and \
                    not np.shares_memory(found, plain):
                return module.launch("getitem", lambda v: v[plain_arrays(key)], (self,), {})
            if isinstance(found, np.generic):
                found = plain[(*(key if isinstance(key, tuple) else (key,)), Ellipsis)]
            return found.view(type(self)) if type(found) is np.ndarray else found

        def __setitem__(self, key: Any, value: Any) -> None:
            """A copy on the device (cupy's ``__setitem__`` reads nothing back)."""
            def assign(target: np.ndarray, source: Any) -> np.ndarray:
                target[key] = source
                return target
            written = np.asarray(self.view(np.ndarray)[plain_arrays(key)]).nbytes
            module.launch("setitem", assign, (self, value), {},
                          (array_bytes((value,)), written))

        def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
            return module.launch("astype", lambda v: v.astype(dtype, *args, **kwargs),
                                 (self,), {})

        def copy(self, order: str = "C") -> Any:
            return module.launch("copy", lambda v: v.copy(order), (self,), {})

        def fill(self, value: Any) -> None:
            module.launch("fill", lambda v: v.fill(value), (self,), {})

        ravel = _copying(module, "ravel")
        flatten = _copying(module, "flatten")
        reshape = _copying(module, "reshape")

        def sum(self, *args: Any, **kwargs: Any) -> Any:
            return module.launch("sum", np.sum, (self, *args), kwargs)

    return DeviceArray


def _copying(module: StandIn, method: str) -> Callable:
    """An ndarray method that returns a view when it can and a copy otherwise: the copy
    is a launch (cupy runs a kernel for it; uncounted, a captured graph would replay a
    stale copy)."""
    def call(self: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        plain = self.view(np.ndarray)
        found = getattr(plain, method)(*args, **kwargs)
        if found.size == 0 or np.shares_memory(found, plain):
            return found.view(type(self))
        return module.launch(method, lambda v: getattr(v, method)(*args, **kwargs),
                             (self,), {})
    return call


def _cuda(ledger: Ledger) -> types.SimpleNamespace:
    """``cupy.cuda``: one device, streams and events (tests/standin_streams.py) whose
    waits are syncs."""
    streams = Streams(ledger)
    device = types.SimpleNamespace(id=0, compute_capability="90",
                                   use=lambda: None,
                                   synchronize=lambda: ledger.sync("device.synchronize"))
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1,
                                    deviceSynchronize=lambda: ledger.sync("deviceSynchronize"))
    return types.SimpleNamespace(Device=lambda index=None: device, runtime=runtime,
                                 Event=streams.Event, Stream=streams.Stream, streams=streams,
                                 get_current_stream=streams.get_current_stream)


# numpy twins of the project's fused cupy kernels (kernels/cuda/fused.py), by name.
def _select(a: Any, b: Any, slope: Any, out: Any = None) -> Any:
    """``a > 0 ? b : b * slope`` (into ``out`` when given): the LeakyReLU kernels."""
    result = np.where(a > 0, b, b * slope)
    if out is None:
        return result
    np.copyto(out, result)
    return out


FUSED: dict[str, Callable] = {
    "cosmotrain_leaky_relu_forward": lambda x, slope, out=None: _select(x, x, slope, out),
    "cosmotrain_leaky_relu_backward": lambda dy, y, slope, out=None: _select(
        y, dy, slope, out),
    "cosmotrain_sum_squares": lambda x, axis: np.sum(
        x.astype(np.float64) * x.astype(np.float64), axis=axis),
    "cosmotrain_sum_products": lambda x, y, axis: np.sum(
        x.astype(np.float64) * y.astype(np.float64), axis=axis),
    "cosmotrain_bn_forward": lambda x, m, s, g, b: (
        (x - m) * s, ((x - m) * s) * g + b),
    "cosmotrain_bn_backward": lambda dy, xh, mdy, mdyx, sc: (
        (dy - (xh * mdyx + mdy)) * sc),
}


class _FusedKernel:
    """An ``ElementwiseKernel`` / ``ReductionKernel``: one launch, computed by its twin."""

    def __init__(self, module: StandIn, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.launch(self.name, FUSED[self.name], args, kwargs)


def _forget_device_state(monkeypatch: Any) -> None:
    """Caches of device objects (compiled fused kernels, uploaded constants) start
    empty, so none made by the stand-in outlives it and none made by real cupy is used."""
    from cosmotrain.kernels.cuda import fused, raw_ops

    fused.kernels.cache_clear()
    monkeypatch.setattr(raw_ops, "_CONSTANTS", {})


_SHARED: list[StandIn] = []


def shared() -> StandIn:
    """The process's one stand-in module: one array class, so an array made under one
    installation (a cached constant) is still a device array under the next."""
    if not _SHARED:
        _SHARED.append(StandIn(Ledger()))
    return _SHARED[0]


@contextlib.contextmanager
def installed(monkeypatch: Any) -> Iterator[StandIn]:
    """The stand-in as ``cupy`` (and our raw kernels on the host launcher) inside."""
    from cuda_host import HostLauncher

    from cosmotrain.device import xp
    from cosmotrain.kernels.cuda import fused, raw, settings

    module = shared()
    module.ledger.clear()
    module.cuda.streams.reset()
    module.graphs.entries, module.graphs.allocator, module.graphs.captures = None, None, 0
    host = HostLauncher()

    def raw_launch(kernel: str, size: int, args: Any) -> None:
        plain = plain_arrays(tuple(args))
        record = Launch(kernel, (size, *describe(plain)), addresses_of(plain),
                        *raw_traffic(kernel, plain))
        module.ledger.launches.append(record)
        host(kernel, size, list(plain))
        module.graphs.record(record, lambda: host(kernel, size, list(plain)))

    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(
        empty_pinned=module.cuda.streams.empty_pinned))  # host memory, remembered
    monkeypatch.setattr(raw, "cupy_launch", raw_launch)
    # cuBLAS's TF32 switch: nothing to switch (numpy's matmul is float32 throughout)
    monkeypatch.setattr(settings, "_cupy_linalg", lambda: types.SimpleNamespace(
        get_compute_type=lambda dtype: 0, set_compute_type=lambda dtype, kind: None,
        COMPUTE_TYPE_TF32=1, COMPUTE_TYPE_DEFAULT=0))
    _forget_device_state(monkeypatch)
    xp.import_cupy.cache_clear()
    try:
        yield module
    finally:
        xp.import_cupy.cache_clear()
        fused.kernels.cache_clear()
