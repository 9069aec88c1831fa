"""Optimizer state sharded over the ranks that replicate each parameter (ZeRO-2 style).

Unsharded, every rank of a reduction group (the replicas of a parameter or of one block of
it) holds the same reduced gradient and the same optimizer state: R copies of momentum or
of Adam's two moments.  With ``parallel.shard_optimizer`` the reducer reduce-scatters each
gradient bucket, so rank ``r`` of the group holds the sum of the bucket's range ``r`` only
(:class:`~cosmotrain.engine.grad_sync.Bucket`), and :class:`OptimizerShards` keeps the
optimizer state of that range only: it updates those elements and all-gathers the new
values into every replica.  The optimizers are element-wise, so the update of a piece is
that piece of the whole update, bit for bit; only the order in which the reduction adds
the ranks' contributions may differ from an allreduce's (float rounding).  Parameters
whose group has one rank (nothing is replicated) take the ordinary update.

State: for a sharded parameter, ``optimizer.state[name]`` holds its array slots over this
rank's piece only (flat, possibly empty: every rank has every name), and its scalar slots
(Adam's ``step``) whole.  Checkpoints do not depend on the sharding:
:meth:`OptimizerShards.gather` assembles the pieces into the rank's parameter blocks on
each group's rank 0, and :meth:`OptimizerShards.cut` cuts blocks back into pieces on
restore, under any group size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.transport import displacements
from cosmotrain.device.xp import to_host
from cosmotrain.layers.hybrid import HybridModel
from cosmotrain.nn.module import Parameter
from cosmotrain.engine.grad_sync import Bucket, GradientReducer
from cosmotrain.engine.optim import Optimizer
from cosmotrain.engine.optim_shards_device import ShardUpdate

State = dict[str, dict[str, Any]]


@dataclass
class OptimizerShards:
    """Updates and state of this rank's shards of ``model``'s bucketed parameters."""

    model: HybridModel
    reducer: GradientReducer
    _device: ShardUpdate = field(default_factory=ShardUpdate, repr=False)  # device_step's

    def __post_init__(self) -> None:
        if not self.reducer.shard:
            raise ValueError("OptimizerShards needs a GradientReducer built with shard=True")
        self._names = {id(p): name for name, p in self.model.named_parameters()}

    def name_of(self, param: Parameter) -> str:
        """``param``'s name in the model (and in the optimizer's state)."""
        return self._names[id(param)]

    def buckets(self) -> list[Bucket]:
        """The reducer's buckets (built on first use)."""
        self.reducer.build(self.model.reduction_groups())
        return self.reducer.buckets

    def step(self, optimizer: Optimizer, params: Iterable[tuple[str, Parameter]],
             lr: float | None = None, skip: bool = False) -> None:
        """One update after :meth:`GradientReducer.finish`: the unbucketed parameters as
        usual, then each bucket's shard, then the all-gather of the new values.

        ``skip`` (this rank's gradients are non-finite) leaves this rank's shards as they
        are but still takes part in the all-gathers, which every rank of the group must
        join; the next step's loss allreduce stops the run."""
        rate = optimizer.lr if lr is None else lr
        if not skip:
            optimizer.step([(n, p) for n, p in params if not self.reducer.owns(p)], rate)
        for bucket in self.buckets():
            grad, values = bucket.shard, self.current_values(bucket)
            for piece in bucket.pieces() if not skip else []:
                optimizer.apply(self.name_of(piece.param), values[piece.span],
                                grad[piece.span], rate)
            self.reducer.start_gather(bucket, values)
        self.reducer.finish_gather()

    def device_step(self, optimizer: Optimizer, params: Iterable[tuple[str, Parameter]],
                    lr: float | None, skip: Any, hyper: Any, prepared: bool = False) -> bool:
        """:meth:`step` on a device, applied or skipped on the device flag ``skip`` in one
        multi-tensor launch reading its hyperparameters from the device buffer ``hyper``
        (``engine/optim_shards_device.py``); False, nothing updated or sent, where those
        kernels do not fit (then the guarded update)."""
        return self._device(self, optimizer, list(params), lr, skip, hyper, prepared)

    @property
    def device_update(self) -> Any:
        """The multi-tensor update :meth:`device_step` launches (its table, its names)."""
        return self._device.multi

    @staticmethod
    def current_values(bucket: Bucket, out: Any = None) -> Any:
        """The current values of this rank's range of ``bucket``'s parameters (a copy;
        into ``out`` when given, an array of the range's size)."""
        a, b = bucket.span
        values = bucket.xp.empty(b - a, dtype=bucket.dtype) if out is None else out
        for piece in bucket.pieces():
            values[piece.span] = piece.param.data.reshape(-1)[piece.lo:piece.hi]
        return values

    def gather(self, state: State) -> State:
        """``state`` with every sharded parameter's slots as whole blocks (host arrays, the
        parameter's shape) on rank 0 of its group, left out on the others (collective over
        every bucket's group, i.e. over every rank); unsharded entries as they are."""
        sharded = {self._names[id(p)] for b in self.buckets() for p in b.params}
        out = {name: slots for name, slots in state.items() if name not in sharded}
        for bucket in self.buckets():
            out.update(self._gather_bucket(bucket, state))
        return out

    def _gather_bucket(self, bucket: Bucket, state: State) -> State:
        names = [self._names[id(p)] for p in bucket.params]
        if names[0] not in state:  # no step yet: no state anywhere in the group
            return {}
        keys = [key for key, value in state[names[0]].items() if np.ndim(value)]
        root = bucket.comm.Get_rank() == 0
        counts = bucket.counts
        out: State = {name: {k: v for k, v in state[name].items() if not np.ndim(v)}
                      for name in names} if root else {}
        for key in keys:
            mine = np.concatenate([np.asarray(to_host(state[name][key])).reshape(-1)
                                   for name in names])
            full = np.empty(sum(counts), mine.dtype) if root else None
            bucket.comm.Gatherv(mine, [full, (counts, displacements(counts))] if root
                                else None, root=0)
            if root:
                offset = 0
                for name, param in zip(names, bucket.params):
                    out[name][key] = full[offset:offset + param.data.size].reshape(
                        param.shape)
                    offset += param.data.size
        return out

    def cut(self, state: State) -> State:
        """``state`` (whole blocks, as :meth:`gather` makes them) with every sharded
        parameter's array slots cut to this rank's piece (flat copies)."""
        out = dict(state)
        for bucket in self.buckets():
            for piece in bucket.pieces():
                name = self.name_of(piece.param)
                if name in state:
                    out[name] = {key: value.reshape(-1)[piece.lo:piece.hi].copy()
                                 if np.ndim(value) else value
                                 for key, value in state[name].items()}
        return out
