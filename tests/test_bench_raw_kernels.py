"""benchmarks/bench_raw_kernels.py: exit 2 naming what is missing without a device; on a
GPU, a row per kernel and precision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, cuda_devices, subprocess_env

SCRIPT = REPO / "benchmarks" / "bench_raw_kernels.py"


def test_bench_raw_kernels(tmp_path: Path) -> None:
    out = tmp_path / "raw.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--width", "16", "--batch", "2",
                           "--repeats", "2", "--out", str(out)], capture_output=True,
                          text=True, env=subprocess_env(), timeout=300, check=False)
    if cuda_devices() == 0:
        assert done.returncode == 2 and "needs cupy and a CUDA device" in done.stderr
        assert not out.exists()
        return
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 18 and all(row["ms"] > 0 for row in rows)
