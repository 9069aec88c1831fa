"""Device buffers through MPI: host staging, CUDA-aware MPI or NCCL, in one place.

Every message of the engine (halo exchanges, redistributions, channel collectives,
gradient and batch-norm reductions) goes through the grid's :class:`DeviceBuffers`:

* **numpy arrays**: the plain mpi4py call on the arrays themselves: no copy, nothing but
  a type check added, so the CPU path is what it was.  bfloat16 arrays travel as their
  16-bit patterns (MPI has no bfloat16 type); reductions take float32 or float64 only
  (callers widen bf16 first: the engine accumulates in float32).
* ``staging`` (the default; works with any MPI, the mpich wheel included): each device
  buffer is copied into pinned host memory, MPI runs on the host copies, and the results
  are copied back.  The current stream is synchronised once, after the device -> host
  copies are queued and before MPI reads the host buffers; copies back are queued on the
  current stream (asynchronous, ordered before the kernels that read them) and their
  pinned buffers stay referenced until an event recorded after them has completed.
* ``cuda-aware``: the device arrays themselves go to MPI (mpi4py reads
  ``__cuda_array_interface__``) once the current stream is synchronised: MPI knows
  nothing of CUDA streams, so pending kernels must have written the sends, and freed
  memory the pool hands out again must no longer be in use, before MPI touches them.
* ``nccl``: NCCL collectives and grouped send/recv queued on the current stream, one NCCL
  communicator per MPI communicator (built on first use, its unique id broadcast over
  that communicator; every use is collective over it).  NCCL work is stream-ordered, so
  neither side waits on the host.

Point-to-point traffic is posted as an :class:`Exchange` (all messages of a halo
exchange: ``recv``/``send``, ``start``, compute, ``wait``), so the halo/compute overlap
survives every mode: with staging, the device -> host copies and one synchronisation
happen in ``start``, the messages travel while the interior is computed, and the host ->
device copies into the margins are queued in ``wait``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.backend import is_device_array

MODES = ("staging", "cuda-aware", "nccl")


def displacements(counts: Sequence[int]) -> list[int]:
    """Offsets of consecutive pieces of ``counts`` elements (MPI's ``displs``)."""
    out, start = [], 0
    for count in counts:
        out.append(start)
        start += int(count)
    return out


def _copyable(array: Any) -> Any:
    """The array as MPI can copy it: bfloat16 as its uint16 bit patterns."""
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def _reducible(array: Any) -> Any:
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"reductions take float32 or float64 buffers, got {array.dtype}; "
                        "widen bfloat16 to float32 first")
    return array


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


class CupyOps:
    """The device operations the staging and NCCL paths need, on cupy's current stream."""

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


@dataclass
class _Retired:
    """Pinned buffers of queued host -> device copies, kept until their event is done."""

    held: list[tuple[Any, list[Any]]] = field(default_factory=list)

    def add(self, event: Any, buffers: list[Any]) -> None:
        self.held = [(e, b) for e, b in self.held if not e.done]
        self.held.append((event, buffers))


class Exchange:
    """One batch of point-to-point messages over ``comm``: post, ``start``, ``wait``."""

    def __init__(self, owner: DeviceBuffers, comm: Any, device: bool) -> None:
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
        mode = self.owner.mode if self.device else "host"
        if mode == "nccl":
            self.owner.nccl_exchange(self.comm, self.sends, self.recvs)
            return
        recvs, sends = self.recvs, self.sends
        if mode == "staging":
            recvs, sends = self._stage_out()
        elif mode == "cuda-aware":
            self.owner.ops.synchronize()
        for source, tag, inbox in recvs:
            self.requests.append(self.comm.Irecv(_copyable(inbox), source=source, tag=tag))
        for dest, tag, packed in sends:
            self.requests.append(self.comm.Isend(_copyable(packed), dest=dest, tag=tag))

    def _stage_out(self) -> tuple[list, list]:
        ops = self.owner.ops
        staged = []
        for dest, tag, packed in self.sends:
            host = ops.pinned(packed.shape, packed.dtype)
            ops.to_host(packed, host)
            staged.append((dest, tag, host))
        self.hosts = [ops.pinned(inbox.shape, inbox.dtype) for _, _, inbox in self.recvs]
        ops.synchronize()
        self.sends = staged  # keep the host copies alive until the sends complete
        return [(s, t, h) for (s, t, _), h in zip(self.recvs, self.hosts)], staged

    def wait(self) -> list[Any]:
        """Wait for the messages; the received arrays, in :meth:`recv` order, on the
        device of the exchange (copies into them queued on the current stream)."""
        _mpi().Request.Waitall(self.requests)
        self.requests = []
        inboxes = [inbox for _, _, inbox in self.recvs]
        if self.device and self.owner.mode == "staging":
            for host, inbox in zip(self.hosts, inboxes):
                self.owner.ops.to_device(host, inbox)
            self.owner.retire(self.hosts)
        return inboxes


class DeviceBuffers:
    """How this job's buffers cross MPI; numpy arrays always take the direct path."""

    def __init__(self, mode: str = "staging", ops: Any = None) -> None:
        if mode not in MODES:
            raise ValueError(f"communication mode must be one of {', '.join(MODES)}, "
                             f"got {mode!r}")
        self.mode = mode
        self._ops = ops
        self._retired = _Retired()
        self._nccl: dict[int, tuple[Any, Any]] = {}

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
        """Build ``comm``'s NCCL communicator now (collective over ``comm``; a no-op in
        the other modes).  For the halo communicator: a rank whose layer has no weight
        block runs no exchange there, so first use is not reached by every rank."""
        if self.mode == "nccl":
            self.nccl_comm(comm)

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
            MPI = _mpi()
            comm.Allreduce(MPI.IN_PLACE, _reducible(array), op=MPI.SUM)
            return
        self.wait([self.iallreduce(comm, array)])

    def iallreduce(self, comm: Any, array: Any) -> tuple[Any, Any, Any]:
        """Start an in-place sum of ``array`` (contiguous) over ``comm``; :meth:`wait`."""
        MPI = _mpi()
        _reducible(array)
        if not self.on_device(array):
            return comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), None, None
        if self.mode == "nccl":
            self.nccl_allreduce(comm, array)
            return None, None, None
        if self.mode == "cuda-aware":
            self.ops.synchronize()
            return comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), None, None
        host = self.ops.pinned(array.shape, array.dtype)
        self.ops.to_host(array, host)
        self.ops.synchronize()
        return comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM), host, array

    def wait(self, pending: Sequence[tuple[Any, Any, Any]]) -> None:
        """Complete :meth:`iallreduce` operations (staging: results copied back)."""
        _mpi().Request.Waitall([request for request, _, _ in pending if request is not None])
        hosts = []
        for _, host, array in pending:
            if host is not None:
                self.ops.to_device(host, array)
                hosts.append(host)
        self.retire(hosts)

    def allgatherv(self, comm: Any, send: Any, recv: Any, counts: Sequence[int]) -> None:
        """Rank ``r``'s ``counts[r]`` elements of ``send``, concatenated into ``recv``."""
        if not self.on_device(send):
            comm.Allgatherv(_copyable(send), [_copyable(recv), (counts, displacements(counts))])
            return
        if self.mode == "nccl":
            self.nccl_allgatherv(comm, send, recv, counts)
            return
        self._via_mpi(lambda s, r: comm.Allgatherv(s, [r, (counts, displacements(counts))]),
                      send, recv)

    def reduce_scatter(self, comm: Any, send: Any, recv: Any, counts: Sequence[int]) -> None:
        """Sum ``send`` over ``comm``; rank ``r`` keeps ``counts[r]`` elements in ``recv``."""
        MPI = _mpi()
        _reducible(send)
        if not self.on_device(send):
            comm.Reduce_scatter(send, recv, list(counts), op=MPI.SUM)
            return
        if self.mode == "nccl":
            self.nccl_reduce_scatter(comm, send, recv, counts)
            return
        self._via_mpi(lambda s, r: comm.Reduce_scatter(s, r, list(counts), op=MPI.SUM),
                      send, recv)

    def alltoallv(self, comm: Any, send: Any, send_counts: Sequence[int], recv: Any,
                  recv_counts: Sequence[int]) -> None:
        """Rank ``q`` gets piece ``q`` of ``send``; piece ``q`` of ``recv`` comes from it."""
        if not self.on_device(send):
            comm.Alltoallv([_copyable(send), (send_counts, displacements(send_counts))],
                           [_copyable(recv), (recv_counts, displacements(recv_counts))])
            return
        if self.mode == "nccl":
            self.nccl_alltoallv(comm, send, send_counts, recv, recv_counts)
            return
        self._via_mpi(lambda s, r: comm.Alltoallv(
            [s, (send_counts, displacements(send_counts))],
            [r, (recv_counts, displacements(recv_counts))]), send, recv)

    def _via_mpi(self, call: Any, send: Any, recv: Any) -> None:
        """A blocking MPI collective on device ``send`` / ``recv`` (contiguous):
        cuda-aware hands MPI the device arrays, staging their pinned host copies."""
        ops = self.ops
        if self.mode == "cuda-aware":
            ops.synchronize()
            call(_copyable(send), _copyable(recv))
            return
        host_send = ops.pinned(send.shape, send.dtype)
        host_recv = ops.pinned(recv.shape, recv.dtype)
        ops.to_host(send, host_send)
        ops.synchronize()
        call(_copyable(host_send), _copyable(host_recv))
        ops.to_device(host_recv, recv)
        self.retire([host_send, host_recv])

    # ---- NCCL ----------------------------------------------------------------------------

    def nccl_comm(self, comm: Any) -> Any:
        """The NCCL communicator of MPI ``comm`` (collective over ``comm`` on first use)."""
        key = id(comm)
        if key not in self._nccl:
            from cupy.cuda import nccl  # type: ignore[import-not-found]

            uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
            uid = comm.bcast(uid, root=0)
            self._nccl[key] = (comm, nccl.NcclCommunicator(comm.Get_size(), uid,
                                                           comm.Get_rank()))
        return self._nccl[key][1]

    def _nccl_lib(self) -> Any:
        from cupy.cuda import nccl  # type: ignore[import-not-found]

        return nccl

    def _nccl_type(self, dtype: Any) -> int:
        nccl = self._nccl_lib()
        types = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}
        return types[np.dtype(dtype).name]

    def _stream(self) -> int:
        return self.ops.stream().ptr

    def nccl_allreduce(self, comm: Any, array: Any) -> None:
        nccl = self._nccl_lib()
        ptr = array.data.ptr
        self.nccl_comm(comm).allReduce(ptr, ptr, array.size, self._nccl_type(array.dtype),
                                       nccl.NCCL_SUM, self._stream())

    def _grouped(self, comm: Any, sends: list[tuple[int, Any]],
                 recvs: list[tuple[int, Any]]) -> None:
        """Send/recv whole contiguous device arrays as bytes, in one NCCL group."""
        nccl = self._nccl_lib()
        nc, stream = self.nccl_comm(comm), self._stream()
        nccl.groupStart()
        try:
            for peer, array in sends:
                if array.size:
                    nc.send(array.data.ptr, array.nbytes, nccl.NCCL_UINT8, peer, stream)
            for peer, array in recvs:
                if array.size:
                    nc.recv(array.data.ptr, array.nbytes, nccl.NCCL_UINT8, peer, stream)
        finally:
            nccl.groupEnd()

    def nccl_exchange(self, comm: Any, sends: list[tuple[int, int, Any]],
                      recvs: list[tuple[int, int, Any]]) -> None:
        """A halo exchange: one message per peer and direction, so tags are not needed."""
        self._grouped(comm, [(peer, array) for peer, _, array in sends],
                      [(peer, array) for peer, _, array in recvs])

    def _pieces(self, flat: Any, counts: Sequence[int]) -> list[Any]:
        return [flat[start:start + int(count)]
                for start, count in zip(displacements(counts), counts)]

    def nccl_allgatherv(self, comm: Any, send: Any, recv: Any, counts: Sequence[int]) -> None:
        me, pieces = comm.Get_rank(), self._pieces(recv.reshape(-1), counts)
        others = [q for q in range(comm.Get_size()) if q != me]
        self.ops.copy(send.reshape(-1), pieces[me])
        self._grouped(comm, [(q, send.reshape(-1)) for q in others],
                      [(q, pieces[q]) for q in others])

    def nccl_alltoallv(self, comm: Any, send: Any, send_counts: Sequence[int], recv: Any,
                       recv_counts: Sequence[int]) -> None:
        me = comm.Get_rank()
        outgoing = self._pieces(send.reshape(-1), send_counts)
        incoming = self._pieces(recv.reshape(-1), recv_counts)
        others = [q for q in range(comm.Get_size()) if q != me]
        self.ops.copy(outgoing[me], incoming[me])
        self._grouped(comm, [(q, outgoing[q]) for q in others],
                      [(q, incoming[q]) for q in others])

    def nccl_reduce_scatter(self, comm: Any, send: Any, recv: Any,
                            counts: Sequence[int]) -> None:
        """Equal pieces: one reduceScatter; uneven ones: one reduce per root, grouped."""
        nccl = self._nccl_lib()
        nc, stream, kind = self.nccl_comm(comm), self._stream(), self._nccl_type(send.dtype)
        if len(set(counts)) == 1:
            nc.reduceScatter(send.data.ptr, recv.data.ptr, int(counts[0]), kind,
                             nccl.NCCL_SUM, stream)
            return
        me, pieces = comm.Get_rank(), self._pieces(send.reshape(-1), counts)
        nccl.groupStart()
        try:
            for root, piece in enumerate(pieces):
                if piece.size:
                    target = recv.data.ptr if root == me else piece.data.ptr
                    nc.reduce(piece.data.ptr, target, piece.size, kind, nccl.NCCL_SUM, root,
                              stream)
        finally:
            nccl.groupEnd()
