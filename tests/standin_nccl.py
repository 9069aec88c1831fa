"""NCCL for the stand-in cupy (tests/standin.py): the NCCL transport's calls carried out
by MPI on the stand-in's host memory, each recorded as a launch, none as a host wait.

Why: NCCL work is queued on the device's stream, so a spatial layout on NCCL makes the
host wait for nothing (docs/GPU.md, "What the CPU verifies").  With this stand-in the
engine's real NCCL transport (``comm/transport/nccl.py``: its pointers, sizes, peers and
groups) runs on the CPU over real MPI, and the step's counts show what NCCL would leave.
Only the communicator is replaced: NCCL's ``NcclCommunicator(size, uid, rank)`` cannot
say which MPI communicator it mirrors, so :func:`installed_nccl` builds one per MPI
communicator instead (``NcclTransport.nccl_comm``).  A group's operations are posted
non-blocking and completed at ``groupEnd``, as NCCL completes a group.  NCCL calls can
be captured in a CUDA graph: during a stand-in capture each call (and each group's start
and end) is kept for the graph to post again at every replay (tests/standin_graph.py).
"""

from __future__ import annotations

import ctypes
import types
from typing import Any

import numpy as np
from standin_ledger import Launch, Ledger

TYPES = {0: np.uint8, 7: np.float32, 8: np.float64}  # NCCL_UINT8, _FLOAT32, _FLOAT64


def _view(ptr: int, count: int, kind: int) -> np.ndarray:
    """The host memory at ``ptr`` as ``count`` elements of NCCL type ``kind``."""
    dtype = np.dtype(TYPES[kind])
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype)


class Group:
    """NCCL's group semantics over MPI: the calls of an open group are posted when the
    outermost ``groupEnd`` comes, then completed (at once outside a group).  Posting at
    the end is NCCL's order: the group's operations run on the stream after everything
    queued before ``groupEnd``, so they read their send buffers as they are then."""

    def __init__(self) -> None:
        self.depth, self.pending, self.requests = 0, [], []

    def start(self) -> None:
        self.depth += 1

    def end(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.complete()

    def call(self, post: Any) -> None:
        """``post()`` posts one MPI request and returns it: now, or at the group's end."""
        self.pending.append(post)
        if self.depth == 0:
            self.complete()

    def complete(self) -> None:
        from mpi4py import MPI

        self.requests = [post() for post in self.pending]
        self.pending = []
        MPI.Request.Waitall(self.requests)
        self.requests = []


class Communicator:
    """An NCCL communicator over MPI ``comm``: the calls ``nccl.py`` makes."""

    def __init__(self, comm: Any, group: Group, ledger: Ledger) -> None:
        self.comm, self.group, self.ledger = comm, group, ledger

    def _call(self, name: str, post: Any, *args: Any) -> None:
        """Record the call, post its MPI request (``post()``: now or at its group's end),
        and keep it for a graph being captured."""
        launch = Launch(f"nccl.{name}", args[1:], args[:1])
        self.ledger.launches.append(launch)
        self.group.call(post)
        _recorder().record(launch, lambda: self.group.call(post))

    def allReduce(self, send: int, recv: int, count: int, kind: int, op: int,
                  stream: int) -> None:
        from mpi4py import MPI

        source, target = _view(send, count, kind), _view(recv, count, kind)
        self._call("allReduce", lambda: self.comm.Iallreduce(
            MPI.IN_PLACE if send == recv else source, target, op=MPI.SUM), send, count, kind)

    def send(self, ptr: int, count: int, kind: int, peer: int, stream: int) -> None:
        self._call("send", lambda: self.comm.Isend(
            _view(ptr, count, kind), dest=peer, tag=77), ptr, count, kind, peer)

    def recv(self, ptr: int, count: int, kind: int, peer: int, stream: int) -> None:
        self._call("recv", lambda: self.comm.Irecv(
            _view(ptr, count, kind), source=peer, tag=77), ptr, count, kind, peer)

    def reduceScatter(self, send: int, recv: int, count: int, kind: int, op: int,
                      stream: int) -> None:
        from mpi4py import MPI

        size = self.comm.Get_size()
        self._call("reduceScatter", lambda: self.comm.Ireduce_scatter_block(
            _view(send, count * size, kind), _view(recv, count, kind), op=MPI.SUM),
            send, count, kind)

    def reduce(self, send: int, recv: int, count: int, kind: int, op: int, root: int,
               stream: int) -> None:
        from mpi4py import MPI

        mine = self.comm.Get_rank() == root
        source = MPI.IN_PLACE if mine and send == recv else _view(send, count, kind)
        self._call("reduce", lambda: self.comm.Ireduce(
            source, _view(recv, count, kind) if mine else None, op=MPI.SUM, root=root),
            send, count, kind, root)


def _recorder() -> Any:
    """The stand-in's capture state (``cupy.graphs``)."""
    import sys

    return sys.modules["cupy"].graphs


def _captured(name: str, call: Any) -> Any:
    """A group call that a capture keeps for the graph's replays too."""
    def calling() -> None:
        call()
        _recorder().record(Launch(f"nccl.{name}", (), ()), call)
    return calling


def module(group: Group) -> types.SimpleNamespace:
    """``cupy.cuda.nccl``: the constants and group calls the transport uses."""
    return types.SimpleNamespace(NCCL_UINT8=0, NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_SUM=0,
                                 groupStart=_captured("groupStart", group.start),
                                 groupEnd=_captured("groupEnd", group.end))


def installed_nccl(monkeypatch: Any, ledger: Ledger) -> None:
    """NCCL on the stand-in: ``cupy.cuda.nccl`` and one communicator per MPI one."""
    import sys

    from cosmotrain.comm.transport import nccl as transport

    group = Group()
    cupy = sys.modules["cupy"]
    monkeypatch.setattr(cupy.cuda, "nccl", module(group), raising=False)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    made: dict[int, Communicator] = {}

    def nccl_comm(self: Any, comm: Any) -> Communicator:
        return made.setdefault(id(comm), Communicator(comm, group, ledger))
    monkeypatch.setattr(transport.NcclTransport, "nccl_comm", nccl_comm)
