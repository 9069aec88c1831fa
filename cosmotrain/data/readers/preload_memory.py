"""Will the preload store fit?  Per node: the bytes its ranks will hold vs available memory.

The ranks sharing a node (``COMM_TYPE_SHARED``) add up what they will hold; the node's
``MemAvailable`` (``/proc/meminfo``) times ``data.memory_fraction`` is the budget; the rest
is left for the model, its activations and the system.  Every rank reaches the same
verdict (allgather), so a store that does not fit on one node stops the whole job with one
clear error before anything is read.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from cosmotrain.comm.collective import agree
from cosmotrain.errors import ConfigError

GIB = float(1 << 30)
MEMINFO = "/proc/meminfo"


def mem_available() -> int | None:
    """Bytes of memory available to new allocations on this node, None if unknown."""
    try:
        with open(MEMINFO) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_preload_memory(comm: Any, rank_bytes: int, fraction: float,
                         available: int | None = None) -> None:
    """Raise the same :class:`ConfigError` on every rank when a node's share does not fit.

    ``rank_bytes``: what this rank's store will hold.  ``available`` overrides the node's
    measured ``MemAvailable`` (tests).
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        node_bytes = node.allreduce(int(rank_bytes))
        if available is None:
            available = node.bcast(mem_available() if node.Get_rank() == 0 else None)
        message = None
        if node.Get_rank() == 0 and available is not None:
            message = _verdict(node_bytes, node.Get_size(), available, fraction)
    finally:
        node.Free()
    agree(comm, message, "ConfigError")


def _verdict(node_bytes: int, ranks: int, available: int, fraction: float) -> str | None:
    budget = available * fraction
    if node_bytes <= budget:
        return None
    return str(ConfigError(
        "data.reader", f"preload needs {node_bytes / GIB:.2f} GiB on node "
        f"{socket.gethostname()} ({ranks} rank(s)) but data.memory_fraction {fraction:g} of "
        f"its {available / GIB:.2f} GiB available memory is {budget / GIB:.2f} GiB",
        "set data.reader: direct, run on more nodes, or raise data.memory_fraction"))
