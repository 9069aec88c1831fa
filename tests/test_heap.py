"""Host memory reuse (``device.reuse_freed_memory``): freed large blocks stay in the heap
for the next step, and a job applies the setting once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cosmotrain.device import heap
from cosmotrain.kernels.cpu.workers import KernelThreads

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists() or heap._mallopt() is None,
                                reason="needs Linux /proc and glibc")

FREED_MIB = """
import sys
import numpy as np
from cosmotrain.device.heap import reuse_freed_memory

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

if sys.argv[1] == "reuse":
    assert reuse_freed_memory()
a = np.ones(96 << 20, np.uint8)
before = rss_mib()
del a
print(before - rss_mib())
"""


def _released_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", FREED_MIB, mode], check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def test_freed_memory_stays_for_reuse_only_when_asked() -> None:
    """glibc's default unmaps a freed 96 MiB array at once; with reuse it stays resident."""
    assert _released_mib("default") > 80
    assert _released_mib("reuse") < 8


@pytest.mark.parametrize("setting", [True, False])
def test_a_job_runtime_applies_the_setting(monkeypatch, setting: bool) -> None:
    """A job (threads given) applies ``device.reuse_freed_memory``; a library call or a
    test building a step without threads leaves the process alone."""
    from mpi4py import MPI

    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.config.layout import resolve_parallel
    from cosmotrain.config.load import load_config
    from cosmotrain.engine.step import job_runtime

    calls: list = []
    monkeypatch.setattr("cosmotrain.runtime.job_runtime.reuse_freed_memory", lambda: calls.append(1))
    monkeypatch.setattr("cosmotrain.runtime.job_runtime.step_memory.install",
                        lambda: calls.append("plan"))
    monkeypatch.setattr("cosmotrain.runtime.job_runtime.configure_threads", lambda threads: None)
    cfg = load_config(None, [f"device.reuse_freed_memory={str(setting).lower()}"])
    grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
    job_runtime(cfg, grid)
    assert calls == []
    job_runtime(cfg, grid, threads=KernelThreads(1))
    assert calls == ([1, "plan"] if setting else [])
    calls.clear()
    cfg.device.plan_step_memory = False
    job_runtime(cfg, grid, threads=KernelThreads(1))
    assert calls == ([1] if setting else [])
