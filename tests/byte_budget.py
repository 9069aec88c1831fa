"""Issue 35's byte budget, measured: the bytes a steady-state GPU training step's
launches read and write (the stand-in cupy, convolutions as cuDNN issues them) against
the step's compulsory traffic (tests/compulsory_traffic.py), and its launches.

Used by tests/test_byte_budget.py (W = 32, in CI) and benchmarks/bench_bytes.py
(W = 128, recorded in docs/PERFORMANCE.md, "GPU: compulsory traffic").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from compulsory_traffic import network_traffic
from standin import shared
from standin_bytes import cudnn_convolutions
from test_gpu_step_counts import training

ITEMSIZE = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Measurement:
    network: str
    width: int
    precision: str
    batch: int
    moved: int  # bytes the step's launches read and wrote
    compulsory: int
    launches: int
    by_kernel: Counter  # bytes moved per kernel name

    @property
    def ratio(self) -> float:
        return self.moved / self.compulsory

    def heaviest(self, count: int = 8) -> list[tuple[str, int]]:
        return self.by_kernel.most_common(count)


def measure(monkeypatch: Any, network: str, width: int, precision: str, batch: int = 1
            ) -> Measurement:
    """Two steps on one rank (the first warms up); the second one's ledger, counted."""
    from mpi4py import MPI

    extra = [f"model.width={width}", f"train.batch_size={batch}",
             f"device.precision={precision}"]
    rng = np.random.default_rng(7)
    x = rng.normal(size=(batch, 4, width, width, width)).astype(np.float32)
    targets = rng.normal(size=(batch, 4)).astype(np.float32)
    cudnn_convolutions(monkeypatch, shared().ledger)
    _, ledgers, _, _ = training(MPI.COMM_SELF, monkeypatch, network, extra, [(x, targets)],
                                steps=2)
    step = ledgers[-1]
    by_kernel: Counter = Counter()
    for launch in step.launches:
        by_kernel[launch.kernel] += launch.read + launch.written
    compulsory = network_traffic(network, width, ITEMSIZE[precision]).total(batch)
    return Measurement(network, width, precision, batch, step.bytes_moved(), compulsory,
                       len(step.launches), by_kernel)
