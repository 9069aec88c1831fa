"""Every CUDA source of the project compiles with NVRTC for sm_80 and sm_90 without a GPU
(cupy's raw NVRTC binding, headers from cupy and the nvidia wheels: the ``cuda-check``
extra, which CI installs), and the sources, the kernel table of kernels/cuda/raw.py and
the package data agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from cosmotrain.kernels.cuda import raw

ROOT = Path(__file__).resolve().parents[1]


def _nvrtc_ready() -> str:
    """Why NVRTC cannot run here, or '' when it can."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as error:  # noqa: BLE001 - ImportError, or no NVRTC library
        return f'NVRTC unavailable ({type(error).__name__}: {error}); pip install -e ".[cuda-check]"'
    if not any((Path(d) / "cuda_bf16.h").exists() for d in raw.include_dirs()):
        return 'cuda_bf16.h not found in the nvidia wheels; pip install -e ".[cuda-check]"'
    return ""


def _entry_points(source: Path) -> set[str]:
    text = source.read_text()
    names = set(re.findall(r'extern "C" __global__ void (\w+)\(', text))
    for name in re.findall(r"^COSMO_BOTH\((\w+),", text, flags=re.MULTILINE):
        names |= {f"{name}_f32", f"{name}_bf16"}
    return names


@pytest.mark.parametrize("arch", raw.ARCHITECTURES)
@pytest.mark.parametrize("source", raw.sources(), ids=lambda p: p.name)
def test_every_source_compiles_with_nvrtc(source: Path, arch: str) -> None:
    reason = _nvrtc_ready()
    if reason:
        pytest.skip(reason)
    cubin = raw.nvrtc_compile(source, arch)
    for name in _entry_points(source):
        assert name.encode() in cubin, f"{name} missing from {source.name}'s {arch} cubin"


def test_the_kernel_table_lists_every_entry_point() -> None:
    found = {name: source.name for source in raw.sources() for name in _entry_points(source)}
    assert found == {name: source for name, (source, _) in raw.KERNELS.items()}


def test_the_sources_ship_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["cosmotrain"]
    shipped = {p for pattern in patterns for p in (ROOT / "cosmotrain").glob(pattern)}
    wanted = set(raw.sources()) | {raw.SOURCE_DIR / h for h in raw.HEADERS}
    assert wanted <= shipped


# Sources whose fused multiply-adds are explicit fmaf calls, not contractions: one
# rounding per step on the device and in the host build alike (glibc's fmaf is the
# correctly rounded one), so the host build's bits are still the device's.
EXPLICIT_FMA = {"conv_direct.cu"}


@pytest.mark.parametrize("source", raw.sources(), ids=lambda p: p.name)
def test_the_device_code_keeps_the_cpus_float32_rounding(source: Path) -> None:
    """No float32 fused multiply-add (outside explicit fmaf calls) and no flushing of
    subnormals in the PTX: each product and sum rounds as numpy's do (the host build's
    bits are the device's)."""
    reason = _nvrtc_ready()
    if reason:
        pytest.skip(reason)
    ptx = raw.nvrtc_ptx(source, "compute_90")
    assert ".entry" in ptx
    assert not re.search(r"\.ftz\b", ptx)
    fused = re.search(r"\bfma\.\w+\.f32", ptx)
    assert bool(fused) == (source.name in EXPLICIT_FMA)
    assert ("fmaf(" in source.read_text()) == (source.name in EXPLICIT_FMA)
