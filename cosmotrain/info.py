"""``cosmotrain info``: versions, MPI library, rank -> host layout and GPU availability.

Collected on every rank (hostnames and visible GPUs differ per node) and gathered to
rank 0, so the report shows the job's real layout under ``mpiexec`` or ``srun``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from typing import Any

import cosmotrain
from cosmotrain.device.probe import nccl_loads
from cosmotrain.device.xp import import_cupy
from cosmotrain.device import step_memory
from cosmotrain.kernels.compiled import direct


def package_versions() -> dict[str, str]:
    """Versions of cosmotrain, Python and the core dependencies."""
    versions = {"cosmotrain": cosmotrain.__version__, "python": platform.python_version()}
    for name in ("numpy", "mpi4py", "h5py", "typer", "rich", "yaml"):
        versions[name] = _module_version(name)
    return versions


def _module_version(name: str) -> str:
    distribution = {"yaml": "PyYAML"}.get(name, name)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def mpi_library() -> str:
    """First line of the MPI library's version string (e.g. ``MPICH Version: 4.2``)."""
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0].strip()


def visible_gpus() -> list[str]:
    """GPUs this process can see, from ``nvidia-smi -L`` (empty when there is none)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU")]


def gpu_libraries() -> dict[str, str]:
    """Availability of cupy (its CUDA runtime and devices), cuDNN, NCCL and ml_dtypes:
    what ``device.backend: gpu``, ``communication: nccl`` and ``precision: bf16`` need;
    and which CUDA major version's wheels provide them."""
    return {"cupy": _cupy_status(), "cuda devices": _cuda_devices(), "cudnn": _cudnn_status(),
            "nccl": _nccl_status(), "ml_dtypes": _module_version("ml_dtypes"),
            "cuda wheels": cuda_route(installed_cuda_wheels())}


#: The wheels of each GPU extra that name a CUDA major version (pyproject.toml).
CUDA_WHEELS = {"12": ("cupy-cuda12x", "nvidia-cudnn-cu12", "nvidia-nccl-cu12"),
               "13": ("cupy-cuda13x", "nvidia-cudnn-cu13", "nvidia-nccl-cu13")}
EXTRA_OF_CUDA = {"12": "gpu", "13": "gpu-cuda13"}


def installed_cuda_wheels() -> dict[str, str]:
    """Version of every installed wheel of :data:`CUDA_WHEELS` (and a source-built
    ``cupy``), by distribution name."""
    wanted = {name for names in CUDA_WHEELS.values() for name in names} | {"cupy"}
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in wanted:
            found[name] = dist.version
    return found


def cuda_route(installed: dict[str, str]) -> str:
    """Which route provides the GPU libraries: the ``gpu`` extra's CUDA 12 wheels, the
    ``gpu-cuda13`` extra's CUDA 13 wheels, or a site install (cupy built from source,
    cuDNN and NCCL from CUDA modules).  Wheels of both majors in one environment are
    named as a problem: cupy loads only its own major's libraries."""
    majors = [major for major, names in CUDA_WHEELS.items()
              if any(name in installed for name in names)]
    listed = ", ".join(f"{name} {installed[name]}" for name in sorted(installed))
    if not majors:
        return f"site install ({listed})" if installed else "none"
    if len(majors) > 1:
        return (f"mixed CUDA 12 and 13 wheels ({listed}): keep one of the extras "
                f"gpu (CUDA 12) or gpu-cuda13")
    major = majors[0]
    if not any(name.startswith("nvidia-cudnn") for name in installed):  # cupy alone
        return (f"CUDA {major}, cupy without cuDNN ({listed}): enough for the NVRTC checks "
                f"of the cuda-check extra; the GPU route is extra {EXTRA_OF_CUDA[major]}")
    return f"CUDA {major} (extra {EXTRA_OF_CUDA[major]}): {listed}"


def _cupy_status() -> str:
    try:
        import cupy  # type: ignore[import-not-found]

        count = cupy.cuda.runtime.getDeviceCount()
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        return f"{cupy.__version__}, CUDA runtime {runtime // 1000}.{runtime % 1000 // 10} " \
               f"({count} device(s))"
    except ImportError:
        return "not installed"
    except Exception as err:  # noqa: BLE001 - a broken CUDA install must not crash info
        return f"installed, unusable: {str(err).splitlines()[0]}"


def _cuda_devices() -> str:
    """The devices CUDA shows this process (CUDA_VISIBLE_DEVICES applied), by name."""
    try:
        import cupy  # type: ignore[import-not-found]

        names = []
        for index in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            names.append(f"{index}: {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB")
        return "; ".join(names) or "none"
    except ImportError:
        return "none (no cupy)"
    except Exception as err:  # noqa: BLE001
        return f"none ({str(err).splitlines()[0]})"


def _nccl_status() -> str:
    if import_cupy()[0] is None:
        return "not available (cupy does not import)"
    if not nccl_loads():
        return ("not loadable (pip install nvidia-nccl-cu12 or nvidia-nccl-cu13, the "
                "CUDA major of cupy)")
    from cupy.cuda import nccl  # type: ignore[import-not-found]

    version = nccl.get_version()
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _cudnn_status() -> str:
    try:
        import cudnn  # type: ignore[import-not-found]

        return f"frontend {getattr(cudnn, '__version__', '?')}, backend {cudnn.backend_version()}"
    except ImportError:
        return "not installed"
    except Exception as err:  # noqa: BLE001
        return f"installed, unusable: {str(err).splitlines()[0]}"


def rank_record(rank: int) -> dict[str, Any]:
    """What one rank reports about itself."""
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gpus": visible_gpus()}


def gather_info(comm: Any) -> dict[str, Any] | None:
    """The full report on rank 0 (None on the other ranks)."""
    records = comm.gather(rank_record(comm.Get_rank()), root=0)
    if comm.Get_rank() != 0:
        return None
    return {"versions": package_versions(), "mpi_library": mpi_library(),
            "world_size": comm.Get_size(), "ranks": records, "gpus": records[0]["gpus"],
            "cpu_kernels": direct.describe(), "host_allocator": step_memory.describe(),
            "gpu_libraries": gpu_libraries()}
