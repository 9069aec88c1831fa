"""What one rank finds on its machine: cupy, visible CUDA devices, NCCL, ml_dtypes, its node.

Each probe answers for this process only and never raises for a missing or broken GPU
stack (that is an answer: "no GPU, because ..."); :mod:`.select` gathers every rank's
:class:`Probe` and decides.  cupy and NCCL are imported here only when asked.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import Any

from cosmotrain.device.xp import import_cupy, one_line


@dataclass(frozen=True)
class Probe:
    """What one rank found on its node (gathered, so every rank decides alike)."""

    host: str
    local_rank: int = 0
    local_size: int = 1
    cupy: str = ""  # cupy's version, '' when it does not import
    devices: int = 0  # CUDA devices visible to this rank
    problem: str = ""  # why there is no usable GPU ('' when there is)
    nccl: bool = False  # cupy.cuda.nccl loads
    ml_dtypes: bool = False  # bfloat16 storage is possible
    bus_ids: tuple[str, ...] = ()  # PCI bus id of each visible device: which GPU it is

    def gpu(self, index: int) -> str:
        """The physical identity of visible device ``index`` (its PCI bus id): ranks whose
        ``CUDA_VISIBLE_DEVICES`` differ number the same GPU differently."""
        return self.bus_ids[index] if index < len(self.bus_ids) else str(index)


def probe_gpu() -> tuple[str, int, str, bool, tuple[str, ...]]:
    """``(cupy version, visible devices, problem, nccl available, PCI bus ids)``."""
    cupy, why = import_cupy()
    if cupy is None:
        return "", 0, f"cupy does not import ({why})", False, ()
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        ids = tuple(cupy.cuda.Device(i).pci_bus_id for i in range(count))
    except Exception as err:  # noqa: BLE001 - no driver, no device: both mean "no GPU"
        return (cupy.__version__, 0, f"CUDA reports no usable device ({one_line(err)})",
                False, ())
    if count == 0:
        return cupy.__version__, 0, "CUDA sees no device (CUDA_VISIBLE_DEVICES?)", False, ()
    return cupy.__version__, count, "", nccl_loads(), ids


def nccl_loads() -> bool:
    """Whether ``cupy.cuda.nccl`` imports and finds libnccl (False without cupy)."""
    with warnings.catch_warnings():  # cupy warns at import when libnccl is missing
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl  # type: ignore[import-not-found]
        except Exception:  # noqa: BLE001
            return False
    return bool(getattr(nccl, "available", False))


def ml_dtypes_imports() -> bool:
    """Whether ml_dtypes is installed (bfloat16 storage)."""
    return importlib.util.find_spec("ml_dtypes") is not None


def node_position(comm: Any) -> tuple[int, int]:
    """``(local rank, local size)``: this rank's place among the ranks of ``comm`` on its
    node (collective); the local rank is what binds a rank to one of the node's GPUs."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    position = local.Get_rank(), local.Get_size()
    local.Free()
    return position
