"""``benchmarks/bench_step.py``: whole training steps per device, checked on the CPU backend
(the GPU rows run the same code on cupy; they ran on an H200, docs/PERFORMANCE.md "GPU")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cuda_devices, mpiexec, subprocess_env

SCRIPT = str(REPO / "benchmarks" / "bench_step.py")
SMALL = ["--backend", "cpu", "--width", "32", "--batch", "2", "--steps", "2", "--warmup", "1"]


def bench(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    command = [sys.executable, SCRIPT, *args]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    return subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)


def test_one_rank_rows_per_precision_and_torch_beside(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    done = bench(*SMALL, "--precisions", "fp32", "tf32", "bf16", "--out", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["results"]
    ours = [r for r in rows if r["impl"] == "cosmotrain numpy"]
    assert [r["precision"] for r in ours] == ["fp32", "bf16"]  # no TF32 on the CPU
    for row in ours:
        assert row["status"] == "ok" and row["strategy"] == "N1" and row["devices"] == 1
        assert row["samples_per_s"] == pytest.approx(2 / row["step_s"])
        assert len(row["step_times_s"]) == 2 and row["memory_mib_max"] > 10
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert len(torch_rows) == (2 if importlib.util.find_spec("torch") else 0)
    assert "| batch | precision | cosmotrain numpy" in done.stdout


def test_ranks_with_a_spatial_split(tmp_path: Path) -> None:
    out = tmp_path / "d2.json"
    done = bench(*SMALL, "--precisions", "fp32", "--set", "parallel.depth=2",
                 "--set", "parallel.sample=1", "--out", str(out), ranks=2)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["results"]  # no torch beside several ranks
    assert row["strategy"] == "D2" and row["ranks"] == 2 and row["devices"] == 2
    assert row["samples_per_s_per_device"] == pytest.approx(row["samples_per_s"] / 2)


def test_layers_and_input_on_the_device(tmp_path: Path) -> None:
    out = tmp_path / "layers.json"
    done = bench(*SMALL, "--precisions", "fp32", "--input", "device", "--layers",
                 "--no-torch", "--set", "model.name=tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["results"]
    layers = row["layers_ms"]
    assert {"conv1 forward", "conv1 backward", "outside the layers"} <= set(layers)
    assert all(ms >= 0 for ms in layers.values()) and layers["conv1 backward"] > 0
    assert "conv1 backward" in done.stdout and "| 2 | fp32 |" in done.stdout


def test_gpu_without_cupy_or_device_exits_2() -> None:
    """Exit 2 naming what is missing: cupy, or (CI installs cupy for its NVRTC check,
    the cuda-check extra) a CUDA device."""
    if cuda_devices() > 0:
        pytest.skip("a CUDA device is visible: the GPU rows would run")
    done = bench("--backend", "gpu", "--width", "32", "--batch", "1", "--steps", "1")
    wanted = "needs cupy" if importlib.util.find_spec("cupy") is None else "needs a CUDA device"
    assert done.returncode == 2 and wanted in done.stderr


def test_stored_int16_input(tmp_path: Path) -> None:
    """``--input stored``: the step takes int16 counts and transforms them itself (on the
    CPU on the host; on a GPU through engine/input_stage.py)."""
    out = tmp_path / "stored.json"
    done = bench(*SMALL, "--precisions", "fp32", "--input", "stored", "--no-torch",
                 "--set", "model.name=tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "ok" and row["samples_per_s"] > 0


def test_graph_rows_capture_inside_the_warm_up_and_only_with_cudnn() -> None:
    """``--graph on``: a cudnn row per graph mode, none for gemm (cuBLAS cannot be
    captured); the capture is the last warm-up step, never a timed one."""
    spec = importlib.util.spec_from_file_location("bench_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--algorithms", "cudnn", "gemm", "--warmup", "3"])
    assert module.row_variants(args) == [("cudnn", False), ("cudnn", True), ("gemm", False)]
    keys = module.overrides(args, 8, "bf16", "cudnn", graph=True)
    assert "device.cuda_graph=true" in keys and "device.cuda_graph_warmup=2" in keys
    assert "device.cuda_graph=false" in module.overrides(args, 8, "bf16", "gemm")
    short = module.parse_args(["--warmup", "2"])  # no warm-up step left to capture in
    assert all(not graph for _, graph in module.row_variants(short))
    cpu = module.parse_args(["--backend", "cpu"])
    assert module.row_variants(cpu) == [("numpy", False)]
    assert not any("cuda_graph" in key for key in module.overrides(cpu, 2, "fp32", "numpy"))
