"""The sharded optimizer's update on a device: one multi-tensor launch that skips on the
step's device flag.

Why: with ``parallel.shard_optimizer`` a device step used to run the update and then
undo it where the skip flag was set (``device_verdict.guarded_update``: a copy of every
parameter and slot, and one ``copyto`` each back, about a hundred launches for the paper
network).  ``kernels/cuda/src/optim.cu``'s ``sgd_momentum_multi`` and ``adam_multi``
skip on the flag themselves and take any list of float32 arrays, so this rank's shard
pieces (their values, their reduced gradient, their slots) and its unbucketed
parameters go into one launch (:class:`~cosmotrain.engine.optim_device.MultiUpdate`),
and the all-gathers then carry the new values, or the old ones where the step was
skipped, to every replica, as :meth:`OptimizerShards.step` does on the CPU.

The pieces are views of the flat arrays the CPU path updates too (one per bucket, this
rank's range), so the update is ``OptimizerShards.step``'s element for element and
(the kernels being ``engine/optim.py``'s operations) its bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cosmotrain.engine.optim import Optimizer
from cosmotrain.engine.optim_device import MultiUpdate
from cosmotrain.engine.step_scalars import pinned_upload

if TYPE_CHECKING:
    from cosmotrain.engine.grad_sync import Bucket
    from cosmotrain.engine.optim_shards import OptimizerShards


@dataclass(frozen=True)
class ShardPiece:
    """One parameter's piece of a bucket's shard, as the multi-tensor update sees it."""

    data: Any
    grad: Any


@dataclass
class ShardUpdate:
    """The device update of :class:`OptimizerShards`, with what it keeps between steps:
    the multi-tensor table and one array per bucket for this rank's values.

    Why keep the value arrays: with them every array of the table (values, the shards'
    gradients, the slots) stays where it is from step to step, so the table is built
    and uploaded once, and a captured CUDA graph would find the same addresses."""

    multi: MultiUpdate = field(default_factory=MultiUpdate)
    values: dict[int, Any] = field(default_factory=dict)  # by id of the bucket

    def __call__(self, shards: OptimizerShards, optimizer: Optimizer, params: list,
                 lr: float | None, skip: Any, hyper: Any, prepared: bool = False) -> bool:
        """One launch updating this rank's pieces and unbucketed parameters, skipped on
        the device where ``skip`` is set, then the all-gathers of every bucket; False,
        nothing updated or sent, where the multi-tensor kernels do not fit (the caller
        falls back to the guarded update).  ``hyper`` and ``prepared`` as for
        :meth:`MultiUpdate.apply` (the step's device buffer of hyperparameters)."""
        buckets = shards.buckets()
        values = [shards.current_values(bucket, self._kept(bucket)) for bucket in buckets]
        named = [(n, p) for n, p in params if not shards.reducer.owns(p)]
        for bucket, flat in zip(buckets, values):
            named += [(shards.name_of(piece.param),
                       ShardPiece(flat[piece.span], bucket.shard[piece.span]))
                      for piece in bucket.pieces()]
        self.multi.upload = self.multi.upload or pinned_upload
        if not self.multi.apply(optimizer, named, lr, skip, hyper, prepared):
            return False
        for bucket, flat in zip(buckets, values):
            shards.reducer.start_gather(bucket, flat)
        shards.reducer.finish_gather()
        return True

    def _kept(self, bucket: Bucket) -> Any:
        """This rank's value array of ``bucket``, allocated at its first step."""
        if id(bucket) not in self.values:
            a, b = bucket.span
            self.values[id(bucket)] = bucket.xp.empty(b - a, dtype=bucket.dtype)
        return self.values[id(bucket)]
