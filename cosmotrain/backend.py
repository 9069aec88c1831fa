"""Array-module selection and GPU binding: numpy on the CPU, cupy on GPUs.

Kernels pick ``xp`` from their inputs (Chainer's convention), so the same code serves both
devices; cupy is imported only when a job selects the GPU (or a probe looks for one).

Which device a job uses (the ``device`` config section) is decided *collectively*: every
rank probes what it has (cupy, its visible CUDA devices, NCCL, ml_dtypes, its place on
its node), the probes are all-gathered, and one pure function, :func:`decide`, turns the
config and all the probes into this rank's :class:`Device`, or into the same
:class:`~cosmotrain.errors.ConfigError` on every rank.  Binding is round robin over a
node's GPUs: ``local rank % GPUs``, where the local rank is the rank's index among the
ranks on its node and the GPUs are the devices CUDA shows it (``CUDA_VISIBLE_DEVICES``
honoured, as CUDA numbers only the visible ones), so several ranks may share one GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import socket
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from cosmotrain.config.device import check_cpu_settings
from cosmotrain.config.schema import AUTO, DeviceConfig
from cosmotrain.errors import ConfigError
from cosmotrain.precision import storage_dtype

INSTALL_GPU = "pip install 'cosmotrain[gpu]'"


@functools.cache
def _import_cupy() -> tuple[ModuleType | None, str]:
    """cupy and '' when it imports, else None and why not (one line)."""
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception as err:  # noqa: BLE001 - a broken CUDA install reads as "no cupy"
        return None, _one_line(err)
    return cupy, ""


def _cupy() -> ModuleType | None:
    return _import_cupy()[0]


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _loaded_cupy() -> ModuleType | None:
    """cupy if some code imported it: no cupy array can exist otherwise, so the checks
    below never import cupy themselves (a CPU run on a machine with cupy stays light)."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and hasattr(cupy, "ndarray") else None


def array_module(*arrays: Any) -> ModuleType:
    """``cupy`` if any argument is a cupy array, else ``numpy``."""
    cupy = _loaded_cupy()
    if cupy is not None:
        for array in arrays:
            if isinstance(array, cupy.ndarray):
                return cupy
    return np


def is_device_array(array: Any) -> bool:
    """Whether ``array`` lives in GPU memory (a cupy array)."""
    cupy = _loaded_cupy()
    return cupy is not None and isinstance(array, cupy.ndarray)


def to_host(array: Any) -> Any:
    """A numpy array: a device array copied to the host, anything else as is."""
    if is_device_array(array):
        return _loaded_cupy().asnumpy(array)  # type: ignore[union-attr]
    return array


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
    cupy, why = _import_cupy()
    if cupy is None:
        return "", 0, f"cupy does not import ({why})", False, ()
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        ids = tuple(cupy.cuda.Device(i).pci_bus_id for i in range(count))
    except Exception as err:  # noqa: BLE001 - no driver, no device: both mean "no GPU"
        return (cupy.__version__, 0, f"CUDA reports no usable device ({_one_line(err)})",
                False, ())
    if count == 0:
        return cupy.__version__, 0, "CUDA sees no device (CUDA_VISIBLE_DEVICES?)", False, ()
    return cupy.__version__, count, "", _nccl_loads(), ids


def _nccl_loads() -> bool:
    with warnings.catch_warnings():  # cupy warns at import when libnccl is missing
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl  # type: ignore[import-not-found]
        except Exception:  # noqa: BLE001
            return False
    return bool(getattr(nccl, "available", False))


def _ml_dtypes_imports() -> bool:
    return importlib.util.find_spec("ml_dtypes") is not None


def probe_rank(comm: Any) -> Probe:
    """This rank's probe (collective over ``comm``: the node-local split)."""
    from cosmotrain.comm import node_position

    local_rank, local_size = node_position(comm)
    version, devices, problem, nccl, ids = probe_gpu()
    return Probe(socket.gethostname(), local_rank, local_size, version, devices, problem,
                 nccl, _ml_dtypes_imports(), ids)


def bind(local_rank: int, gpus: int) -> int:
    """The GPU of a rank: its local rank modulo the node's GPUs (round robin)."""
    if gpus < 1 or local_rank < 0:
        raise ValueError(f"bind needs gpus >= 1 and local_rank >= 0, got {gpus}, {local_rank}")
    return local_rank % gpus


@dataclass(frozen=True)
class Device:
    """Where this rank's arrays live and how they are stored and communicated."""

    kind: str = "cpu"  # cpu | gpu
    index: int | None = None  # CUDA device number among the visible ones
    precision: str = "fp32"
    communication: str = "staging"
    conv_algorithm: str = AUTO
    shared_by: int = 1  # ranks of this node bound to the same GPU

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def xp(self) -> ModuleType:
        """The array module of this device."""
        if not self.is_gpu:
            return np
        cupy = _cupy()
        if cupy is None:
            raise RuntimeError("a gpu Device without cupy: build it with select_device")
        return cupy

    @property
    def storage_dtype(self) -> np.dtype:
        """float32, or bfloat16 under ``precision: bf16``."""
        return storage_dtype(self.precision)

    def to_device(self, array: Any, dtype: Any = None) -> Any:
        """``array`` on this device (in ``dtype`` when given); no copy when it is already
        there in that dtype.  On a GPU the cast runs after the copy, on the device."""
        moved = self.xp.asarray(array)
        if dtype is not None and moved.dtype != np.dtype(dtype):
            moved = moved.astype(dtype)
        return moved

    def activate(self) -> None:
        """Make this rank's GPU current and set its math modes (no-op on the CPU)."""
        if not self.is_gpu:
            return
        self.xp.cuda.Device(self.index).use()
        from cosmotrain.gpu.settings import ConvSettings, configure

        configure(ConvSettings(algorithm=self.conv_algorithm,
                               math="tf32" if self.precision == "tf32" else "fp32"))

    def describe(self) -> str:
        """One line for logs and ``--dry-run``: device, precision, communication."""
        if not self.is_gpu:
            return f"cpu (numpy), precision {self.precision}"
        shared = f", shared by {self.shared_by} ranks" if self.shared_by > 1 else ""
        return (f"gpu {self.index}{shared} (cupy), precision {self.precision}, "
                f"convolutions {self.conv_algorithm}, communication {self.communication}")


def decide(cfg: DeviceConfig, probes: Sequence[Probe], rank: int) -> Device:
    """This rank's device from the config and every rank's probe (pure; every rank gets
    the same answer or raises the same error)."""
    backend = _backend(cfg, probes)
    _check_modes(cfg, probes, backend)
    if backend == "cpu":
        return Device("cpu", None, cfg.precision)
    indices = [bind(p.local_rank, _gpus(cfg, p, r)) for r, p in enumerate(probes)]
    gpus = [(p.host, p.gpu(i)) for p, i in zip(probes, indices)]
    shared = gpus.count(gpus[rank])
    if cfg.communication == "nccl":
        _check_nccl(probes, gpus)
    return Device("gpu", indices[rank], cfg.precision, cfg.communication,
                  cfg.conv_algorithm, shared)


def _first_without_gpu(probes: Sequence[Probe]) -> tuple[int, Probe] | None:
    return next(((r, p) for r, p in enumerate(probes) if p.devices < 1), None)


def _where(rank: int, probe: Probe) -> str:
    return f"rank {rank} (host {probe.host})"


def _backend(cfg: DeviceConfig, probes: Sequence[Probe]) -> str:
    """cpu or gpu; ``gpu`` demands cupy and a device on every rank."""
    missing = _first_without_gpu(probes)
    if cfg.backend == AUTO:
        return "cpu" if missing is not None else "gpu"
    if cfg.backend == "gpu" and missing is not None:
        rank, probe = missing
        if not probe.cupy:
            raise ConfigError("device.backend", f"gpu needs cupy, and {_where(rank, probe)} "
                              f"has none: {probe.problem}",
                              f"{INSTALL_GPU} on every node, or use device.backend: cpu")
        raise ConfigError("device.backend", f"gpu needs a CUDA device on every rank, and "
                          f"{_where(rank, probe)} has none: {probe.problem}",
                          "check the driver and CUDA_VISIBLE_DEVICES, or use "
                          "device.backend: cpu")
    return cfg.backend


def _check_modes(cfg: DeviceConfig, probes: Sequence[Probe], backend: str) -> None:
    """Precision and GPU-only settings against the backend chosen."""
    lacking = next(((r, p) for r, p in enumerate(probes) if not p.ml_dtypes), None)
    if cfg.precision == "bf16" and lacking is not None:
        raise ConfigError("device.precision", f"bf16 storage needs ml_dtypes, which "
                          f"{_where(*lacking)} cannot import",
                          f"pip install ml_dtypes (or {INSTALL_GPU})")
    if backend == "cpu":
        check_cpu_settings(cfg, "" if cfg.backend == "cpu" else _no_gpu_reason(probes))


def _no_gpu_reason(probes: Sequence[Probe]) -> str:
    missing = _first_without_gpu(probes)
    if missing is None:
        return ""
    return f" (device.backend: auto found no GPU on {_where(*missing)}: {missing[1].problem})"


def _gpus(cfg: DeviceConfig, probe: Probe, rank: int) -> int:
    """How many of its node's GPUs a rank binds among: all visible, or gpus_per_node."""
    if cfg.gpus_per_node == AUTO:
        return probe.devices
    wanted = int(cfg.gpus_per_node)
    if wanted > probe.devices:
        raise ConfigError("device.gpus_per_node", f"{wanted} GPUs asked for, but "
                          f"{_where(rank, probe)} sees {probe.devices}",
                          f"use at most {probe.devices} or auto")
    return wanted


def _check_nccl(probes: Sequence[Probe], gpus: Sequence[tuple[str, str]]) -> None:
    """NCCL must load everywhere and cannot put two ranks on one GPU."""
    for rank, probe in enumerate(probes):
        if not probe.nccl:
            raise ConfigError("device.communication", f"nccl, but cupy.cuda.nccl does not "
                              f"load on {_where(rank, probe)}",
                              "pip install 'nvidia-nccl-cu12>=2.18.1,<3' (part of "
                              f"{INSTALL_GPU}), or use communication: staging")
    seen: dict[tuple[str, str], int] = {}
    for rank, gpu in enumerate(gpus):
        other = seen.setdefault(gpu, rank)
        if other != rank:
            raise ConfigError("device.communication", f"nccl needs one GPU per rank, but "
                              f"ranks {other} and {rank} share GPU {gpu[1]} of host "
                              f"{gpu[0]}", "run at most one rank per GPU, or use "
                              "communication: staging or cuda-aware")


def select_device(cfg: DeviceConfig, comm: Any) -> Device:
    """This rank's device, bound and activated (collective over ``comm``)."""
    probes = comm.allgather(probe_rank(comm))
    device = decide(cfg, probes, comm.Get_rank())
    device.activate()
    return device


def host_device(cfg: DeviceConfig) -> Device:
    """The CPU in the config's precision, without probing (library calls and tests)."""
    decide(DeviceConfig(backend="cpu", precision=cfg.precision),
           [Probe("", ml_dtypes=cfg.precision != "bf16" or _ml_dtypes_imports())], 0)
    return Device("cpu", None, cfg.precision)
