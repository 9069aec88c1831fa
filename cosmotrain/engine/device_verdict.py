"""A GPU step's verdicts kept on the device: no host wait inside a steady-state step.

On the CPU the step reads its loss and its gradient check as it goes (a host read costs
nothing there).  On a device each such read makes the host wait for every kernel queued
before it (about 20 ms a read on the H200 at batch 8, docs/PERFORMANCE.md "GPU"), so a
device step keeps them where they are computed:

* the loss sum and the guards' votes form one float64 device vector (:func:`vote_vector`),
  summed over the ranks in the step's one allreduce (on the device through the job's
  transport: staging MPI copies it to the host once, NCCL would not) and read by the
  host once, when it asks (:class:`DeferredSums`, behind ``StepOutput.loss`` and
  ``.votes``): after the step, never inside it;
* whether the step may be applied (a finite loss, no rank voting bad gradients) and
  whether this rank's gradients are finite are device flags (:func:`apply_flag`,
  :func:`gradients_nonfinite`);
* the update applies or skips on the device flag (``engine/optim_device.py``: one
  multi-tensor launch; else :func:`guarded_update`, the update undone where the flag is
  set), so a non-finite step is never applied, on a device as on the CPU, without the
  host looking.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module, to_host
from cosmotrain.engine.votes import Votes


@dataclass
class DeferredSums:
    """The step's ``[loss sum, vote sums...]`` on the device, read by the host at most
    once (:meth:`read`), whenever it first asks."""

    values: Any
    global_count: int
    votes: Votes  # this rank's votes: their class gives the sums their type
    _host: np.ndarray | None = field(default=None, repr=False)

    def read(self) -> tuple[float, Votes]:
        """``(mean loss, votes summed over the ranks)``: one device -> host read."""
        if self._host is None:
            self._host = np.asarray(to_host(self.values), dtype=np.float64)
        return float(self._host[0]) / self.global_count, self.votes.summed(self._host[1:])


def vote_vector(total: Any, votes: Votes, bad_gradients: Any, base: Any = None) -> Any:
    """``[total, *votes]`` as one float64 device vector: ``total`` (the loss sum, a
    device scalar), ``votes`` as cast on the host but for ``bad_gradients``, which comes
    from the device flag of the previous step.  ``base``: ``[0, *votes]`` already in
    device memory (``engine/step_scalars.py``), copied on the device, which a captured
    graph replays with each step's votes; without it the votes are uploaded (a few
    doubles)."""
    xp = array_module(total)
    if base is not None:
        values = base.copy()
    else:
        values = xp.asarray(np.asarray((0.0, *votes.values()), dtype=np.float64))
    values[0] = total
    if bad_gradients is not None:
        where = 1 + [f.name for f in fields(votes)].index("bad_gradients")
        values[where] = bad_gradients
    return values


def apply_flag(sums: Any, votes: Votes) -> Any:
    """Device bool: the step may be applied (the summed loss finite, no rank's previous
    gradients non-finite), ``StepOutput.finite`` without a host read."""
    xp = array_module(sums)
    where = 1 + [f.name for f in fields(votes)].index("bad_gradients")
    return xp.isfinite(sums[0]) & (sums[where] == 0)


def gradients_nonfinite(arrays: Iterable[Any]) -> Any:
    """Device bool: some element of some array is NaN or infinite.

    Each array is summed in float64: NaN and Inf propagate, and no sum of float32 (or
    bfloat16) values can overflow float64, so the verdict is exact without the CPU's
    element-wise second look (:func:`cosmotrain.device.xp.all_finite`)."""
    present = [a for a in arrays if a is not None and a.size]
    if not present:
        return None
    xp = array_module(*present)
    total = xp.stack([a.sum(dtype=np.float64) for a in present]).sum()
    return ~xp.isfinite(total)


def guarded_update(written: Callable[[], Sequence[Any]], skip: Any,
                   update: Callable[[], None]) -> None:
    """Run ``update``, which writes the arrays ``written()`` lists in place (parameters,
    optimizer slots), and put them back where the device flag ``skip`` is set; slots
    the update creates (its first step) are zeroed there, what a fresh slot holds.

    Why a copy and not a branch: a branch is a host read.  The copies are one read and
    one write of the parameters and slots per step, small beside the activations (the
    paper network's 9.4 M parameters against 620 MB of activation traffic per sample).
    The step uses it only where the multi-tensor kernels, which skip on the flag
    themselves, do not fit (``engine/optim_device.py``)."""
    before = list(written())
    if not before:
        update()
        return
    xp = array_module(*before)
    saved = [array.copy() for array in before]
    update()
    for array, old in zip(before, saved):
        xp.copyto(array, old, where=skip)
    known = {id(array) for array in before}
    for array in written():
        if id(array) not in known:
            xp.copyto(array, array.dtype.type(0), where=skip)
