"""This rank's :class:`Device`: the collective decision and GPU binding.

Which device a job uses (the ``device`` config section) is decided *collectively*: every
rank probes what it has (:mod:`.probe`: cupy, its visible CUDA devices, NCCL, ml_dtypes,
its place on its node), the probes are all-gathered, and one pure function, :func:`decide`,
turns the config and all the probes into this rank's :class:`Device`, or into the same
:class:`~cosmotrain.errors.ConfigError` on every rank.  Binding is round robin over a
node's GPUs: ``local rank % GPUs``, where the local rank is the rank's index among the
ranks on its node and the GPUs are the devices CUDA shows it (``CUDA_VISIBLE_DEVICES``
honoured, as CUDA numbers only the visible ones), so several ranks may share one GPU.

The :class:`Device` is a value: where arrays live, their storage precision, the
communication mode (:func:`cosmotrain.comm.transport.make_transport`) and the requested
convolution algorithm.  The convolution settings derived from it belong to the kernels
(:func:`cosmotrain.kernels.cuda.settings.settings_for`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from cosmotrain.config.device import check_cpu_settings
from cosmotrain.config.schema import AUTO, DeviceConfig
from cosmotrain.errors import ConfigError
from cosmotrain.precision import storage_dtype

from cosmotrain.device.probe import Probe, ml_dtypes_imports, node_position, probe_gpu
from cosmotrain.device.xp import import_cupy

# as README.md and docs/GPU.md say: the CUDA 12 or the CUDA 13 wheels
INSTALL_GPU = 'pip install -e ".[gpu]" (CUDA 12) or -e ".[gpu-cuda13]" (CUDA 13)'


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
    cudnn_autotune: bool = False
    conv1_channels_pad: int = 0
    conv1_algorithm: str = "default"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def xp(self) -> ModuleType:
        """The array module of this device."""
        if not self.is_gpu:
            return np
        cupy = import_cupy()[0]
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
        """Make this rank's GPU current (no-op on the CPU)."""
        if self.is_gpu:
            self.xp.cuda.Device(self.index).use()

    def _conv1(self) -> str:
        """conv1's own settings for :meth:`describe` ('' when both are the defaults)."""
        parts = ([f"channels padded to a multiple of {self.conv1_channels_pad}"]
                 if self.conv1_channels_pad else [])
        parts += ["direct kernel"] if self.conv1_algorithm == "direct" else []
        return f"conv1 {', '.join(parts)}, " if parts else ""

    def describe(self) -> str:
        """One line for logs and ``--dry-run``: device, precision, communication."""
        if not self.is_gpu:
            return f"cpu (numpy), precision {self.precision}"
        shared = f", shared by {self.shared_by} ranks" if self.shared_by > 1 else ""
        return (f"gpu {self.index}{shared} (cupy), precision {self.precision}, "
                f"convolutions {self.conv_algorithm}"
                f"{' (cuDNN plans autotuned)' if self.cudnn_autotune else ''}, "
                f"{self._conv1()}"
                f"communication {self.communication}")


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
                  cfg.conv_algorithm, shared, cfg.cudnn_autotune, cfg.conv1_channels_pad,
                  cfg.conv1_algorithm)


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
                              "pip install nvidia-nccl-cu12 or nvidia-nccl-cu13, the "
                              f"CUDA major of cupy (part of {INSTALL_GPU}), or use "
                              "communication: staging")
    seen: dict[tuple[str, str], int] = {}
    for rank, gpu in enumerate(gpus):
        other = seen.setdefault(gpu, rank)
        if other != rank:
            raise ConfigError("device.communication", f"nccl needs one GPU per rank, but "
                              f"ranks {other} and {rank} share GPU {gpu[1]} of host "
                              f"{gpu[0]}", "run at most one rank per GPU, or use "
                              "communication: staging or cuda-aware")


def probe_rank(comm: Any) -> Probe:
    """This rank's probe (collective over ``comm``: the node-local split)."""
    local_rank, local_size = node_position(comm)
    version, devices, problem, nccl, ids = probe_gpu()
    return Probe(socket.gethostname(), local_rank, local_size, version, devices, problem,
                 nccl, ml_dtypes_imports(), ids)


def select_device(cfg: DeviceConfig, comm: Any) -> Device:
    """This rank's device, bound to its GPU (collective over ``comm``)."""
    probes = comm.allgather(probe_rank(comm))
    device = decide(cfg, probes, comm.Get_rank())
    device.activate()
    return device


def host_device(cfg: DeviceConfig) -> Device:
    """The CPU in the config's precision, without probing (library calls and tests)."""
    decide(DeviceConfig(backend="cpu", precision=cfg.precision),
           [Probe("", ml_dtypes=cfg.precision != "bf16" or ml_dtypes_imports())], 0)
    return Device("cpu", None, cfg.precision)
