"""The regression loss of a data-parallel batch: global mean, local gradient.

Each rank holds the predictions of some samples of the global batch (possibly none).
The loss is the mean over *all* elements of the batch, so its gradient is this rank's
``d(sum)/d(pred) / global count`` and the summed parameter gradients equal the
single-process ones whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.timers import PhaseTimers
from cosmotrain.device.xp import array_module
from cosmotrain.kernels.loss import GRADS, TOTALS, total_and_grad


def loss_and_sums(pred: Any, target: Any, global_count: int, grid: ProcessGrid | None = None,
                  timers: PhaseTimers | None = None, kind: str = "mse",
                  extra: Sequence[float] = ()) -> tuple[float, Any, np.ndarray]:
    """``(loss over the global batch, d loss / d pred for the local rows)``, plus ``extra``
    summed over every rank in the same allreduce.

    The step's guard votes (:class:`~cosmotrain.engine.votes.Votes`) ride along with the
    loss: one message of a few doubles instead of one more collective per step, and every
    rank gets the same sums, so every rank takes the same decision.  The sum goes through
    the grid (:meth:`~cosmotrain.comm.grid.ProcessGrid.sum_all`), timed as ``allreduce``.
    """
    if pred.shape != target.shape:
        raise ValueError(f"predictions {pred.shape} and targets {target.shape} differ")
    target = array_module(pred).asarray(target)  # the targets join the predictions' device
    summed = np.array([float(TOTALS[kind](pred, target)), *extra], dtype=np.float64)
    if grid is not None and grid.layout.size > 1:  # one rank: nothing to sum, or to time
        with (timers or PhaseTimers()).phase("allreduce"):
            grid.sum_all(summed)
    return (float(summed[0]) / global_count, GRADS[kind](pred, target, global_count),
            summed[1:])


def loss_sums_on_device(pred: Any, target: Any, global_count: int,
                        vector: Callable[[Any], Any], grid: ProcessGrid,
                        transport: Any, timers: PhaseTimers | None = None,
                        kind: str = "mse") -> tuple[Any, Any]:
    """:func:`loss_and_sums` for device predictions, reading nothing back: ``(sums,
    d loss / d pred)`` where ``sums = vector(loss sum)`` (a float64 device vector: the
    loss sum and the votes, ``engine.device_verdict.vote_vector``) summed over every
    rank through ``transport`` (staging MPI: one device -> host copy and one stream
    synchronisation; NCCL: a device collective)."""
    if pred.shape != target.shape:
        raise ValueError(f"predictions {pred.shape} and targets {target.shape} differ")
    target = array_module(pred).asarray(target)
    total, grad = total_and_grad(kind, pred, target, global_count)
    sums = vector(total)
    if grid.layout.size > 1:
        with (timers or PhaseTimers()).phase("allreduce"):
            transport.allreduce(grid.group_comms["all"], sums)
    return sums, grad
