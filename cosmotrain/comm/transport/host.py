"""The host transport: numpy arrays straight to mpi4py, nothing else.

The transport of a CPU job (and the process grid's until a GPU job sets its own): every
call is the plain mpi4py call on the caller's arrays (:class:`~.base.Transport`).  A
device array here is a wiring error, reported as a ``TypeError`` naming the fix.
"""

from __future__ import annotations

from cosmotrain.comm.transport.base import Transport


class HostTransport(Transport):
    """numpy pass-through; device arrays need a device transport."""

    mode = "host"
