"""The NCCL transport: collectives and grouped send/recv queued on the current stream.

One NCCL communicator per MPI communicator, built on first use (or by :meth:`prepare`):
its unique id is broadcast over that communicator, so every use is collective over it.
NCCL work is stream-ordered, so neither side waits on the host.  Point-to-point traffic
(a halo exchange) sends one message per peer and direction, so tags are not needed;
uneven pieces (all-gather, all-to-all, reduce-scatter) become one grouped call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cosmotrain.comm.transport.base import Exchange, Pending, Transport, displacements


def _nccl() -> Any:
    from cupy.cuda import nccl  # type: ignore[import-not-found]

    return nccl


class NcclTransport(Transport):
    """Device buffers through NCCL; numpy ones still through MPI."""

    mode = "nccl"

    def __init__(self, ops: Any = None) -> None:
        super().__init__(ops)
        self._comms: dict[int, tuple[Any, Any]] = {}

    def prepare(self, comm: Any) -> None:
        """Build ``comm``'s NCCL communicator now (collective over ``comm``).  For the
        halo communicator: a rank whose layer has no weight block runs no exchange
        there, so first use is not reached by every rank."""
        self.nccl_comm(comm)

    def nccl_comm(self, comm: Any) -> Any:
        """The NCCL communicator of MPI ``comm`` (collective over ``comm`` on first use)."""
        key = id(comm)
        if key not in self._comms:
            nccl = _nccl()
            uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
            uid = comm.bcast(uid, root=0)
            self._comms[key] = (comm, nccl.NcclCommunicator(comm.Get_size(), uid,
                                                            comm.Get_rank()))
        return self._comms[key][1]

    def _type(self, dtype: Any) -> int:
        nccl = _nccl()
        types = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}
        return types[np.dtype(dtype).name]

    def _stream(self) -> int:
        return self.ops.stream().ptr

    def _device_iallreduce(self, comm: Any, array: Any) -> Pending:
        ptr = array.data.ptr
        self.nccl_comm(comm).allReduce(ptr, ptr, array.size, self._type(array.dtype),
                                       _nccl().NCCL_SUM, self._stream())
        return None, None, None

    def _grouped(self, comm: Any, sends: list[tuple[int, Any]],
                 recvs: list[tuple[int, Any]]) -> None:
        """Send/recv whole contiguous device arrays as bytes, in one NCCL group."""
        nccl = _nccl()
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

    def _device_start(self, batch: Exchange) -> None:
        self._grouped(batch.comm, [(peer, array) for peer, _, array in batch.sends],
                      [(peer, array) for peer, _, array in batch.recvs])

    def _pieces(self, flat: Any, counts: Sequence[int]) -> list[Any]:
        return [flat[start:start + int(count)]
                for start, count in zip(displacements(counts), counts)]

    def _device_allgatherv(self, comm: Any, send: Any, recv: Any,
                           counts: Sequence[int]) -> None:
        me, pieces = comm.Get_rank(), self._pieces(recv.reshape(-1), counts)
        others = [q for q in range(comm.Get_size()) if q != me]
        self.ops.copy(send.reshape(-1), pieces[me])
        self._grouped(comm, [(q, send.reshape(-1)) for q in others],
                      [(q, pieces[q]) for q in others])

    def _device_alltoallv(self, comm: Any, send: Any, send_counts: Sequence[int], recv: Any,
                          recv_counts: Sequence[int]) -> None:
        me = comm.Get_rank()
        outgoing = self._pieces(send.reshape(-1), send_counts)
        incoming = self._pieces(recv.reshape(-1), recv_counts)
        others = [q for q in range(comm.Get_size()) if q != me]
        self.ops.copy(outgoing[me], incoming[me])
        self._grouped(comm, [(q, outgoing[q]) for q in others],
                      [(q, incoming[q]) for q in others])

    def _device_reduce_scatter(self, comm: Any, send: Any, recv: Any,
                               counts: Sequence[int]) -> None:
        """Equal pieces: one reduceScatter; uneven ones: one reduce per root, grouped."""
        nccl = _nccl()
        nc, stream, kind = self.nccl_comm(comm), self._stream(), self._type(send.dtype)
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
