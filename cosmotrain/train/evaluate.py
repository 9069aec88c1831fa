"""Inference over a split: per-sample predictions and MSE / MAE per target (collective).

The model runs in evaluation mode (batch norm on its running statistics, no dropout).
Each rank predicts the rows of each batch it holds after the redistribution to whole
samples; error sums are allreduced over every rank, so each sample counts exactly once
whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from cosmotrain.data.readers.base import Reader
from cosmotrain.device import step_memory
from cosmotrain.device.xp import to_host
from cosmotrain.nn.module import Context
from cosmotrain.precision import widen
from cosmotrain.engine.step import HybridStep


@dataclass
class Errors:
    """Mean squared and absolute error per target over ``count`` samples."""

    count: int
    mse: np.ndarray
    mae: np.ndarray

    @property
    def mean_mae(self) -> float:
        return float(np.mean(self.mae))


def predictions(step: HybridStep, reader: Reader, epoch: int = 0
                ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(global sample indices, predictions, targets)`` of this rank's rows, per batch;
    the predictions as host arrays (float32 also under bf16 storage)."""
    ctx = Context(training=False, seed=0)
    for index in range(reader.batches_per_epoch):
        # read, predicted and freed inside one planned phase (device/step_memory.py)
        with step_memory.phase("eval"):
            batch = reader.batch(epoch, index)
            pred = step.model.forward(step.place_input(batch.x), ctx)
            start, stop = step.model.sample_range()
            rows = (batch.indices[start:stop], np.asarray(widen(to_host(pred))),
                    batch.targets[start:stop])
            del batch, pred
        yield rows


def evaluate(step: HybridStep, reader: Reader, outputs: int,
             on_batch: Callable[[], None] | None = None) -> Errors:
    """MSE and MAE per target over the whole split (every rank gets the same result).

    ``on_batch`` is called after each batch (the trainer's watchdog beat: a long
    validation is progress, batch by batch)."""
    from mpi4py import MPI

    sums = np.zeros(1 + 2 * outputs)
    for _, pred, target in predictions(step, reader):
        diff = pred.astype(np.float64) - target
        sums += np.concatenate([[len(diff)], (diff ** 2).sum(axis=0), np.abs(diff).sum(axis=0)])
        if on_batch is not None:
            on_batch()
    step.grid.group_comms["all"].Allreduce(MPI.IN_PLACE, sums)
    count = max(int(sums[0]), 1)
    return Errors(int(sums[0]), sums[1:1 + outputs] / count, sums[1 + outputs:] / count)
