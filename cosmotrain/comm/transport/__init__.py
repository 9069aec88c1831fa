"""Transports: how device (and host) buffers cross MPI, one module each, one factory.

Every message of the engine (halo exchanges, redistributions, channel collectives,
gradient and batch-norm reductions) goes through the job's runtime transport, a
:class:`~.base.Transport` made by :func:`make_transport` from the job's
``device.communication``:

* ``host`` (:mod:`.host`): numpy arrays straight to mpi4py, the CPU path;
* ``staging`` (:mod:`.staging`, the config's default): device buffers through pinned host
  copies, with any MPI;
* ``cuda-aware`` (:mod:`.cuda_aware`): device buffers to a CUDA-aware MPI;
* ``nccl`` (:mod:`.nccl`): NCCL collectives and grouped send/recv on the current stream.

numpy arrays take the same direct mpi4py call in every transport (:mod:`.base`, with what
the transports share: the interface, point-to-point batches, the cupy operations).  The
transports take MPI communicators as arguments; they import nothing from cosmotrain.comm.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.comm.transport.base import CupyOps, Exchange, Transport, displacements
from cosmotrain.comm.transport.cuda_aware import CudaAwareTransport
from cosmotrain.comm.transport.host import HostTransport
from cosmotrain.comm.transport.nccl import NcclTransport
from cosmotrain.comm.transport.staging import StagingTransport

TRANSPORTS: dict[str, type[Transport]] = {
    "host": HostTransport, "staging": StagingTransport, "cuda-aware": CudaAwareTransport,
    "nccl": NcclTransport}


def make_transport(mode: str = "host", ops: Any = None) -> Transport:
    """The transport of ``mode`` (``host`` or a ``device.communication`` value); ``ops``:
    the device operations (:class:`CupyOps` on first device use when None; tests pass
    fakes)."""
    if mode not in TRANSPORTS:
        raise ValueError(f"communication mode must be one of {', '.join(TRANSPORTS)}, "
                         f"got {mode!r}")
    return TRANSPORTS[mode](ops)


__all__ = ["CupyOps", "Exchange", "Transport", "TRANSPORTS", "displacements",
           "make_transport"]
