"""benchmarks/bench_batchnorm.py: exit 2 naming what is missing without a device; its
rows computed on the stand-in cupy (tests/standin.py: our batch-norm kernels by their
host build, the fused cupy kernels by their numpy twins) at tiny sizes, so that every
line the device run takes has run: both routes at every stage, in fp32 and bf16, agree
(bf16 within one rounding), and the table pairs each of our rows with the cupy path's."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import REPO, cuda_devices, subprocess_env
from standin import installed

SCRIPT = REPO / "benchmarks" / "bench_batchnorm.py"


def wall_ms(xp: Any, run: Callable[[], Any], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) * 1e3 / repeats


def test_bench_batchnorm_rows_on_the_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_batchnorm

    assert bench_batchnorm.shapes(128, 8, 16)[0] == (8, 16, 128, 128, 128)
    assert bench_batchnorm.shapes(128, 8, 16)[3] == (8, 128, 16, 16, 16)
    with installed(monkeypatch) as cupy:
        table = bench_batchnorm.rows(cupy, 8, 2, 2, ["fp32", "bf16"], 1, wall_ms)
        kernels = {launch.kernel for launch in cupy.ledger.launches}
    assert len(table) == 2 * 4 * 2 * 2  # precisions x stages x passes x routes
    assert {"channel_sums_f32", "bn_train_forward_bf16", "bn_backward_apply_f32",
            "cosmotrain_bn_forward", "cosmotrain_sum_products"} <= kernels
    pairs = bench_batchnorm.pairs(table)
    assert len(pairs) == len(table) // 2
    for ours, theirs in pairs:
        assert (ours["route"], theirs["route"]) == ("ours", "cupy")
        assert ours["shape"] == theirs["shape"] and ours["pass"] == theirs["pass"]
        assert ours["max_gap"] <= (0.05 if ours["precision"] == "bf16" else 1e-5), ours
        assert ours["bytes"] > 0 and ours["ms"] > 0


@pytest.mark.skipif(cuda_devices() > 0, reason="a device is visible: gpu_check.sh runs it")
def test_bench_batchnorm_needs_a_device() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--width", "8", "--batch", "1",
                           "--repeats", "1"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120, check=False)
    assert done.returncode == 2 and "needs cupy and a CUDA device" in done.stderr
