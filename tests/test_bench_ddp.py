"""``benchmarks/bench_ddp.py --check`` on 2 ranks: PyTorch's multi-rank peers (the
hand-written depth split, DistributedDataParallel) give the one-process twin's loss and
gradients, and cosmotrain's first loss on the same batch is the same."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO, mpiexec, subprocess_env

SCRIPT = str(REPO / "benchmarks" / "bench_ddp.py")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="PyTorch (the yardstick) is not installed")


@pytest.mark.parametrize("model, width, batch, strategy", [
    ("cosmoflow", 16, 2, "D"),         # avg-pool halos (below only), conv halos
    ("cosmoflow-mlperf", 32, 1, "D"),  # conv halos both ways, local max-pool
    ("cosmoflow", 16, 2, "N"),         # DDP
])
def test_peer_matches_the_one_process_twin(model: str, width: int, batch: int,
                                           strategy: str) -> None:
    command = [mpiexec(), "-n", "2", sys.executable, SCRIPT, "--model", model, "--width",
               str(width), "--batch", str(batch), "--strategy", strategy, "--check"]
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": ok" in done.stdout
    assert f"{strategy}2: PyTorch" in done.stdout
