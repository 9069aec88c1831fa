"""benchmarks/bench_dense.py and gpu_check.sh's bench-dense stage: the dry run (numpy, our
kernels' host build) gives a row per network, layer, batch, precision and pass with ours
and the library within summation error of each other; without a device the stage runs
and the script exits 2 naming what is missing (with a device: the real table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, cuda_devices, subprocess_env

SCRIPT = REPO / "benchmarks" / "bench_dense.py"
CHECK = REPO / "benchmarks" / "gpu_check.sh"


def test_dry_run_covers_both_heads_every_pass_and_agrees(tmp_path: Path) -> None:
    out = tmp_path / "dense.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--width", "32",
                           "--batch", "1", "3", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 3 * 2 * 3  # precisions, networks, layers, batches, passes
    assert {(r["network"], r["layer"], r["inputs"], r["outputs"]) for r in rows} >= {
        ("paper", "fc2", 2048, 256), ("mlperf", "fc1", 512, 128)}
    assert all(r["ours_ms"] > 0 and r["cublas_ms"] > 0 for r in rows)
    for row in rows:  # float32 sums in two orders; bf16 one rounding apart at most
        assert row["difference"] <= (1e-5 if row["precision"] == "fp32" else 2 ** -7), row


def test_the_gpu_check_stage(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(CHECK)], check=False).returncode == 0
    done = subprocess.run(["bash", str(CHECK), "bench-dense"], cwd=REPO, capture_output=True,
                          text=True, env={**subprocess_env(), "OUT": str(tmp_path)},
                          timeout=300, check=False)
    summary = (tmp_path / "summary.txt").read_text()
    log = (tmp_path / "bench-dense.log").read_text()
    if cuda_devices() == 0:
        assert "== bench-dense: exit 2" in summary, (summary, done.stderr)
        assert "bench_dense: needs cupy and a CUDA device" in log  # its arguments parsed
        assert not (tmp_path / "dense_w128.json").exists()
        return
    assert "== bench-dense: exit 0" in summary, log
    assert len(json.loads((tmp_path / "dense_w128.json").read_text())["rows"]) == 108
