"""benchmarks/bench_conv1.py: exit 2 naming what is missing without a device; every case
it times run once on the CPU through the stand-in cupy (gemm standing in for cuDNN, our
direct kernel through its host build), agreeing with the first setting's output."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import REPO, cuda_devices, subprocess_env
from cuda_host import need_compiler
from standin import installed

SCRIPT = REPO / "benchmarks" / "bench_conv1.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_conv1", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_conv1_needs_a_device() -> None:
    if cuda_devices():
        pytest.skip("a CUDA device is here: benchmarks/gpu_check.sh bench-conv1 runs it")
    done = subprocess.run([sys.executable, str(SCRIPT), "--width", "8", "--batch", "1"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300,
                          check=False)
    assert done.returncode == 2 and "bench_conv1: needs cupy and a CUDA device" in done.stderr


def test_every_case_runs_on_the_standin(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    need_compiler()
    bench = bench_module()
    timed = []

    def timer(fn, repeats: int) -> float:
        fn()
        timed.append(repeats)
        return 0.5

    out = tmp_path / "conv1.json"
    args = bench.parse(["--width", "6", "--batch", "1", "--precisions", "fp32", "tf32",
                        "bf16", "--repeats", "3", "--out", str(out)])
    with installed(monkeypatch) as cupy:
        monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: types.SimpleNamespace(
            free_all_blocks=lambda: None), raising=False)
        rows = bench.run(cupy, args, "gemm", timer)
    assert json.loads(out.read_text())["rows"] == rows
    assert len(rows) == len(timed) == 6 * 6 and set(timed) == {3}
    assert [(r["how"], r["pass"]) for r in rows[:6]] == [
        (how, kind) for how in ("gemm", "gemm pad8", "direct") for kind in ("forward", "wgrad")]
    for r in rows:
        limit = 2.0 ** -7 if r["precision"] == "bf16" else 1e-5
        assert r["rel_diff"] <= limit, r
        assert r["tflops"] == pytest.approx(bench.flops(r["network"], 6, 1) / 0.5e9)
    assert bench.table(rows).count("\n") == len(rows) + 1
