"""The CUDA-aware transport: device arrays handed to MPI as they are.

mpi4py reads ``__cuda_array_interface__``, so a CUDA-aware MPI library moves device
memory itself.  MPI knows nothing of CUDA streams: the current stream is synchronised
before every call, so pending kernels have written the sends, and memory the pool hands
out again is no longer in use, before MPI touches them.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.comm.transport.base import (Call, Exchange, MpiDeviceTransport, Pending, copyable,
                                             mpi)


class CudaAwareTransport(MpiDeviceTransport):
    """Device buffers straight to a CUDA-aware MPI, after a stream synchronisation."""

    mode = "cuda-aware"

    def _device_iallreduce(self, comm: Any, array: Any) -> Pending:
        MPI = mpi()
        self.ops.synchronize()
        return comm.Iallreduce(MPI.IN_PLACE, array, op=MPI.SUM), None, None

    def via_mpi(self, call: Call, send: Any, recv: Any) -> None:
        self.ops.synchronize()
        call(copyable(send), copyable(recv))

    def _device_start(self, batch: Exchange) -> None:
        self.ops.synchronize()
        batch.post(batch.recvs, batch.sends)
