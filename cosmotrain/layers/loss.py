"""The regression loss of a data-parallel batch: global mean, local gradient.

Each rank holds the predictions of some samples of the global batch (possibly none).
The loss is the mean over *all* elements of the batch, so its gradient is this rank's
``d(sum)/d(pred) / global count`` and the summed parameter gradients equal the
single-process ones whatever the split.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cosmotrain.backend import array_module
from cosmotrain.comm.timers import PhaseTimers
from cosmotrain.kernels.loss import mae_backward, mae_sum, mse_backward, mse_sum

LOSSES = {"mse": (mse_sum, mse_backward), "mae": (mae_sum, mae_backward)}


def batch_loss(pred: Any, target: Any, global_count: int, comm: Any = None,
               timers: PhaseTimers | None = None, kind: str = "mse") -> tuple[float, Any]:
    """``(loss over the global batch, d loss / d pred for the local rows)``."""
    if pred.shape != target.shape:
        raise ValueError(f"predictions {pred.shape} and targets {target.shape} differ")
    total, grad = LOSSES[kind]
    target = array_module(pred).asarray(target)  # the targets join the predictions' device
    summed = np.array([total(pred, target)])
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        with (timers or PhaseTimers()).phase("allreduce"):
            comm.Allreduce(MPI.IN_PLACE, summed)
    return float(summed[0]) / global_count, grad(pred, target, global_count)
