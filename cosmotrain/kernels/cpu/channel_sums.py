"""Per-channel sums of an (N, C, ...) array (a bias gradient), on the kernel worker pool.

Why: numpy's ``dy.sum(axis=(0, 2, 3, 4))`` runs on one core; on the output gradient of
the MLPerf network's first convolution (2 x 32 x 128^3 float32) it took 80 ms of a
training step, while the other core waited.  numpy reduces such an array as one pairwise
sum per contiguous (sample, channel) block, added into the channel's total sample by
sample; blocks of channels are independent, so the workers each take some channels and
keep that order: the results are bit for bit numpy's (checked in
``tests/test_elementwise.py``).

cupy arrays and bfloat16 storage take the plain expression (accumulated in float32).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.precision import accumulator

from cosmotrain.kernels.cpu import workers

# Elements per block of channels handed to one worker.
BLOCK_ELEMENTS = 1 << 20


def channel_sums(dy: Any) -> Any:
    """``dy.sum`` over every axis but 1, in ``dy``'s accumulator dtype."""
    total = accumulator(dy.dtype)
    if array_module(dy) is not np or total != dy.dtype or dy.ndim < 2 or dy.size == 0:
        return dy.sum(axis=(0,) + tuple(range(2, dy.ndim)), dtype=total)
    dy = np.ascontiguousarray(dy)
    n, c = dy.shape[:2]
    rows = dy.reshape(n, c, dy.size // (n * c))
    out = np.zeros(c, dtype=total)
    per = max(1, BLOCK_ELEMENTS // max(1, n * rows.shape[2]))

    def work(c0: int) -> None:
        c1 = min(c, c0 + per)
        for i in range(n):
            out[c0:c1] += np.add.reduce(rows[i, c0:c1], axis=1)

    workers.map_chunks(work, list(range(0, c, per)))
    return out
