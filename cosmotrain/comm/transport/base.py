"""What every transport shares: the numpy path, the interface, point-to-point batches.

:class:`Transport` is the interface the engine calls (``allreduce``, ``iallreduce`` /
``wait``, ``allgatherv``, ``reduce_scatter``, their in-place non-blocking forms
``ireduce_scatter`` / ``iallgatherv``, ``alltoallv``, ``exchange``, ``prepare``).
numpy arrays always take the plain mpi4py call on the arrays themselves (no copy, only a
type check added), in every transport; device arrays go to the ``_device_*`` hooks that
each transport module implements.  bfloat16 travels as its 16-bit patterns (MPI has no
bfloat16 type); reductions take float32 or float64 only (callers widen bf16 first).

:class:`Exchange` is one batch of point-to-point messages (all messages of a halo
exchange: ``recv``/``send``, ``start``, compute, ``wait``), so the halo/compute overlap
survives every transport.  :class:`CupyOps` are the device operations the staging,
CUDA-aware and NCCL transports need, on cupy's current stream (tests pass fakes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.device.xp import is_device_array

Pending = tuple[Any, Any, Any]  # (MPI request or None, pinned host copy or None, array)


def displacements(counts: Sequence[int]) -> list[int]:
    """Offsets of consecutive pieces of ``counts`` elements (MPI's ``displs``)."""
    out, start = [], 0
    for count in counts:
        out.append(start)
        start += int(count)
    return out


def copyable(array: Any) -> Any:
    """The array as MPI can copy it: bfloat16 as its uint16 bit patterns."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def reducible(array: Any) -> Any:
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"reductions take float32 or float64 buffers, got {array.dtype}; "
                        "widen bfloat16 to float32 first")
    return array


def mpi() -> Any:
    from mpi4py import MPI

    return MPI


# The blocking MPI collectives on buffers MPI can read (host arrays, or device arrays for
# CUDA-aware MPI), ``call(send, recv)`` as :meth:`MpiDeviceTransport.via_mpi` hands them.
Call = Callable[[Any, Any], None]


def allgatherv_call(comm: Any, counts: Sequence[int]) -> Call:
    return lambda s, r: comm.Allgatherv(s, [r, (counts, displacements(counts))])


def reduce_scatter_call(comm: Any, counts: Sequence[int]) -> Call:
    return lambda s, r: comm.Reduce_scatter(s, r, list(counts), op=mpi().SUM)


def alltoallv_call(comm: Any, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Call:
    return lambda s, r: comm.Alltoallv([s, (send_counts, displacements(send_counts))],
                                       [r, (recv_counts, displacements(recv_counts))])


class CupyOps:
    """The device operations the device transports need, on cupy's current stream."""

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found]
        import cupyx  # type: ignore[import-not-found]

        self.cupy, self.cupyx = cupy, cupyx

    def is_device(self, array: Any) -> bool:
        return isinstance(array, self.cupy.ndarray)

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        return self.cupy.empty(tuple(shape), dtype=dtype)

    def pinned(self, shape: Sequence[int], dtype: Any) -> Any:
        return self.cupyx.empty_pinned(tuple(shape), dtype=dtype)

    def contiguous(self, array: Any) -> Any:
        return self.cupy.ascontiguousarray(array)

    def stream(self) -> Any:
        return self.cupy.cuda.get_current_stream()

    def to_host(self, device: Any, host: Any) -> None:
        """Queue the copy ``device -> host`` (pinned) on the current stream."""
        device.get(stream=self.stream(), out=host, blocking=False)

    def to_device(self, host: Any, device: Any) -> None:
        """Queue the copy ``host (pinned) -> device`` on the current stream."""
        device.set(host, stream=self.stream())

    def synchronize(self) -> None:
        self.stream().synchronize()

    def event(self) -> Any:
        """An event recorded on the current stream (``.done`` once the work before it ran)."""
        return self.stream().record()

    def copy(self, source: Any, target: Any) -> None:
        target[...] = source


class Exchange:
    """One batch of point-to-point messages over ``comm``: post, ``start``, ``wait``."""

    def __init__(self, owner: Transport, comm: Any, device: bool) -> None:
        self.owner, self.comm, self.device = owner, comm, device
        self.recvs: list[tuple[int, int, Any]] = []  # (source, tag, inbox)
        self.sends: list[tuple[int, int, Any]] = []  # (dest, tag, packed)
        self.requests: list[Any] = []
        self.hosts: list[Any] = []  # staging: host inboxes, in recv order

    def recv(self, shape: Sequence[int], dtype: Any, source: int, tag: int) -> None:
        """Expect an array of ``shape`` from ``source`` (returned by :meth:`wait`)."""
        ops = self.owner.ops if self.device else None
        inbox = ops.empty(shape, dtype) if ops is not None else np.empty(shape, dtype)
        self.recvs.append((source, tag, inbox))

    def send(self, array: Any, dest: int, tag: int) -> None:
        """Send ``array`` (any strides: packed here) to ``dest``."""
        ops = self.owner.ops if self.device else None
        packed = ops.contiguous(array) if ops is not None else np.ascontiguousarray(array)
        self.sends.append((dest, tag, packed))

    def start(self) -> None:
        """Post everything; returns at once (the messages travel while the caller computes)."""
        if self.device:
            self.owner._device_start(self)
        else:
            self.post(self.recvs, self.sends)

    def post(self, recvs: list[tuple[int, int, Any]], sends: list[tuple[int, int, Any]]
             ) -> None:
        """Post ``recvs`` and ``sends`` (buffers MPI can read) as non-blocking MPI calls."""
        for source, tag, inbox in recvs:
            self.requests.append(self.comm.Irecv(copyable(inbox), source=source, tag=tag))
        for dest, tag, packed in sends:
            self.requests.append(self.comm.Isend(copyable(packed), dest=dest, tag=tag))

    def wait(self) -> list[Any]:
        """Wait for the messages; the received arrays, in :meth:`recv` order, on the
        device of the exchange (copies into them queued on the current stream)."""
        mpi().Request.Waitall(self.requests)
        self.requests = []
        inboxes = [inbox for _, _, inbox in self.recvs]
        if self.device:
            self.owner._device_finish(self)
        return inboxes


@dataclass
class _Retired:
    """Pinned buffers of queued host -> device copies, kept until their event is done."""

    held: list[tuple[Any, list[Any]]] = field(default_factory=list)

    def add(self, event: Any, buffers: list[Any]) -> None:
        self.held = [(e, b) for e, b in self.held if not e.done]
        self.held.append((event, buffers))


class Transport:
    """How this job's buffers cross MPI; numpy arrays always take the direct path.

    A transport module implements the ``_device_*`` hooks for device arrays; ``ops``
    (:class:`CupyOps` unless given) is created on first use by a device array only.
    """

    mode = ""

    def __init__(self, ops: Any = None) -> None:
        self._ops = ops
        self._retired = _Retired()

    @property
    def ops(self) -> Any:
        if self._ops is None:
            self._ops = CupyOps()
        return self._ops

    def on_device(self, array: Any) -> bool:
        """Whether ``array`` is a device array (numpy never is; cupy is not imported)."""
        if self._ops is not None:
            return self._ops.is_device(array)
        return is_device_array(array)

    def prepare(self, comm: Any) -> None:
        """Set up what first use over ``comm`` would (collective over ``comm``); only
        NCCL has anything to set up."""

    def retire(self, buffers: list[Any]) -> None:
        """Keep pinned ``buffers`` alive until the work queued so far has run."""
        if buffers:
            self._retired.add(self.ops.event(), buffers)

    # ---- point to point ------------------------------------------------------------------

    def exchange(self, comm: Any, like: Any) -> Exchange:
        """A batch of messages of arrays living where ``like`` lives."""
        return Exchange(self, comm, self.on_device(like))

    # ---- collectives ---------------------------------------------------------------------

    def allreduce(self, comm: Any, array: Any) -> None:
        """Sum ``array`` (contiguous) over ``comm``, in place."""
        if not self.on_device(array):
            MPI = mpi()
            comm.Allreduce(MPI.IN_PLACE, reducible(array), op=MPI.SUM)
            return
        self.wait([self.iallreduce(comm, array)])

    def iallreduce(self, comm: Any, array: Any) -> Pending:
        """Start an in-place sum of ``array`` (contiguous) over ``comm``; :meth:`wait`."""
        reducible(array)
        if not self.on_device(array):
            MPI = mpi()
            return comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), None, None
        return self._device_iallreduce(comm, array)

    def wait(self, pending: Sequence[Pending]) -> None:
        """Complete :meth:`iallreduce` operations (staging: results copied back)."""
        mpi().Request.Waitall([request for request, _, _ in pending if request is not None])
        hosts = []
        for _, host, array in pending:
            if host is not None:
                self.ops.to_device(host, array)
                hosts.append(host)
        self.retire(hosts)

    def ireduce_scatter(self, comm: Any, array: Any, counts: Sequence[int]) -> Pending:
        """Start an in-place sum of ``array`` (contiguous, ``sum(counts)`` elements) over
        ``comm`` of which rank ``r`` keeps its ``counts[r]`` elements, at the *start* of
        its ``array`` (MPI's in-place reduce-scatter; the rest is left undefined);
        :meth:`wait`.  Device arrays are reduced before it returns (blocking)."""
        reducible(array)
        if not self.on_device(array):
            MPI = mpi()
            return comm.Ireduce_scatter(MPI.IN_PLACE, array, list(counts), op=MPI.SUM), \
                None, None
        mine = self.ops.empty((counts[comm.Get_rank()],), array.dtype)
        self._device_reduce_scatter(comm, array, mine, counts)
        self.ops.copy(mine, array[:mine.size])
        return None, None, None

    def iallgatherv(self, comm: Any, array: Any, counts: Sequence[int]) -> Pending:
        """Start an in-place all-gather: rank ``r``'s ``counts[r]`` elements, at their place
        in ``array`` (``displacements(counts)[r]``), reach every rank's ``array``;
        :meth:`wait`.  Device arrays are gathered before it returns (blocking)."""
        if not self.on_device(array):
            MPI = mpi()
            spec = [copyable(array), (list(counts), displacements(counts))]
            return comm.Iallgatherv(MPI.IN_PLACE, spec), None, None
        start = displacements(counts)[comm.Get_rank()]
        mine = self.ops.empty((counts[comm.Get_rank()],), array.dtype)
        self.ops.copy(array[start:start + mine.size], mine)
        self._device_allgatherv(comm, mine, array, counts)
        return None, None, None

    @staticmethod
    def test(pending: Pending) -> bool:
        """Whether a pending operation has completed (lets MPI progress; :meth:`wait`
        still has to finish it)."""
        request = pending[0]
        return request is None or request.Test()

    def allgatherv(self, comm: Any, send: Any, recv: Any, counts: Sequence[int]) -> None:
        """Rank ``r``'s ``counts[r]`` elements of ``send``, concatenated into ``recv``."""
        if not self.on_device(send):
            allgatherv_call(comm, counts)(copyable(send), copyable(recv))
            return
        self._device_allgatherv(comm, send, recv, counts)

    def reduce_scatter(self, comm: Any, send: Any, recv: Any, counts: Sequence[int]) -> None:
        """Sum ``send`` over ``comm``; rank ``r`` keeps ``counts[r]`` elements in ``recv``."""
        reducible(send)
        if not self.on_device(send):
            reduce_scatter_call(comm, counts)(send, recv)
            return
        self._device_reduce_scatter(comm, send, recv, counts)

    def alltoallv(self, comm: Any, send: Any, send_counts: Sequence[int], recv: Any,
                  recv_counts: Sequence[int]) -> None:
        """Rank ``q`` gets piece ``q`` of ``send``; piece ``q`` of ``recv`` comes from it."""
        if not self.on_device(send):
            alltoallv_call(comm, send_counts, recv_counts)(copyable(send), copyable(recv))
            return
        self._device_alltoallv(comm, send, send_counts, recv, recv_counts)

    # ---- device arrays: one implementation per transport module --------------------------

    def _device_iallreduce(self, comm: Any, array: Any) -> Pending:
        raise self._no_device_path()

    def _device_allgatherv(self, comm: Any, send: Any, recv: Any,
                           counts: Sequence[int]) -> None:
        raise self._no_device_path()

    def _device_reduce_scatter(self, comm: Any, send: Any, recv: Any,
                               counts: Sequence[int]) -> None:
        raise self._no_device_path()

    def _device_alltoallv(self, comm: Any, send: Any, send_counts: Sequence[int], recv: Any,
                          recv_counts: Sequence[int]) -> None:
        raise self._no_device_path()

    def _device_start(self, batch: Exchange) -> None:
        raise self._no_device_path()

    def _device_finish(self, batch: Exchange) -> None:
        """After the messages of ``batch`` arrived (nothing to do unless staged)."""

    def _no_device_path(self) -> TypeError:
        return TypeError(f"the {self.mode or type(self).__name__} transport moves numpy "
                         "arrays only; build the job's transport with "
                         "make_transport(device.communication) for device arrays")


class MpiDeviceTransport(Transport, ABC):
    """Device arrays through MPI itself (staging, CUDA-aware): the collectives differ only
    in the buffers :meth:`via_mpi` hands to the MPI call."""

    @abstractmethod
    def via_mpi(self, call: Call, send: Any, recv: Any) -> None:
        """Run the blocking MPI collective ``call`` on device ``send`` / ``recv``."""

    def _device_allgatherv(self, comm: Any, send: Any, recv: Any,
                           counts: Sequence[int]) -> None:
        self.via_mpi(allgatherv_call(comm, counts), send, recv)

    def _device_reduce_scatter(self, comm: Any, send: Any, recv: Any,
                               counts: Sequence[int]) -> None:
        self.via_mpi(reduce_scatter_call(comm, counts), send, recv)

    def _device_alltoallv(self, comm: Any, send: Any, send_counts: Sequence[int], recv: Any,
                          recv_counts: Sequence[int]) -> None:
        self.via_mpi(alltoallv_call(comm, send_counts, recv_counts), send, recv)
