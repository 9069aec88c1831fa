"""The staging transport (the default; works with any MPI, the mpich wheel included).

Each device buffer is copied into pinned host memory, MPI runs on the host copies, and
the results are copied back.  The current stream is synchronised once, after the
device -> host copies are queued and before MPI reads the host buffers; copies back are
queued on the current stream (asynchronous, ordered before the kernels that read them)
and their pinned buffers stay referenced until an event recorded after them has
completed (:meth:`~.base.Transport.retire`).  In a halo exchange the device -> host
copies and the one synchronisation happen in ``start``, the messages travel while the
interior is computed, and the host -> device copies into the margins are queued in
``wait``.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.comm.transport.base import (Call, Exchange, MpiDeviceTransport, Pending, copyable,
                                             mpi)


class StagingTransport(MpiDeviceTransport):
    """Device buffers through pinned host copies."""

    mode = "staging"

    def _device_iallreduce(self, comm: Any, array: Any) -> Pending:
        MPI = mpi()
        host = self.ops.pinned(array.shape, array.dtype)
        self.ops.to_host(array, host)
        self.ops.synchronize()
        return comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM), host, array

    def via_mpi(self, call: Call, send: Any, recv: Any) -> None:
        ops = self.ops
        host_send = ops.pinned(send.shape, send.dtype)
        host_recv = ops.pinned(recv.shape, recv.dtype)
        ops.to_host(send, host_send)
        ops.synchronize()
        call(copyable(host_send), copyable(host_recv))
        ops.to_device(host_recv, recv)
        self.retire([host_send, host_recv])

    def _device_start(self, batch: Exchange) -> None:
        ops = self.ops
        staged = []
        for dest, tag, packed in batch.sends:
            host = ops.pinned(packed.shape, packed.dtype)
            ops.to_host(packed, host)
            staged.append((dest, tag, host))
        batch.hosts = [ops.pinned(inbox.shape, inbox.dtype) for _, _, inbox in batch.recvs]
        ops.synchronize()
        batch.sends = staged  # keep the host copies alive until the sends complete
        batch.post([(s, t, h) for (s, t, _), h in zip(batch.recvs, batch.hosts)], staged)

    def _device_finish(self, batch: Exchange) -> None:
        for host, (_, _, inbox) in zip(batch.hosts, batch.recvs):
            self.ops.to_device(host, inbox)
        self.retire(batch.hosts)
