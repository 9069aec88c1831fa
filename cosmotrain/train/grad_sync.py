"""Gradient reduction in buckets, overlapped with the backward pass.

Every rank of a parameter's reduction group holds a replica of it (or of the same block
of it, under channel/filter parallelism) and computes a partial gradient (its samples,
its spatial blocks).  The groups come from the model (``HybridModel.reduction_groups``):
a block is reduced only among the ranks that hold it, never in one global allreduce.  Each group's parameters
are grouped, in reverse model order (roughly the order backward finishes them), into
buckets of about ``bucket_mb`` MiB, each with one persistent flat buffer.  Before a step
:meth:`GradientReducer.prepare` zeroes the buffers and makes every ``param.grad`` a view
of its bucket, so layers accumulate straight into it (gradients are never held twice).
When the last parameter of a bucket is reported final (``Context.on_grad_ready``), the
bucket's non-blocking allreduce starts and backward goes on while it travels;
:meth:`finish` waits, and the sums are already in place.  Readiness is the same on every
rank, so the collectives start in the same order everywhere.  With one rank in the group
nothing is allocated or sent for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.timers import PhaseTimers
from cosmotrain.device.transport import Transport, make_transport
from cosmotrain.device.xp import array_module
from cosmotrain.nn.module import Layer, Parameter

DEFAULT_BUCKET_MB = 25.0  # as PyTorch DDP


@dataclass
class _Bucket:
    comm: Any
    params: list[Parameter]
    buffer: Any
    ready: int = 0


def plan_buckets(params: list[Parameter], bucket_bytes: float) -> list[list[Parameter]]:
    """Consecutive groups of ``params`` of at least ``bucket_bytes`` (the last may be less)."""
    groups: list[list[Parameter]] = [[]]
    size = 0
    for param in params:
        if size >= bucket_bytes and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += param.data.nbytes
    return [g for g in groups if g]


Groups = Iterable[tuple[Any, Iterable[Parameter]]]


@dataclass
class GradientReducer:
    """Sums parameter gradients over their groups in buckets of about ``bucket_mb`` MiB."""

    timers: PhaseTimers
    bucket_mb: float = DEFAULT_BUCKET_MB
    transport: Transport = field(default_factory=make_transport)  # device buckets
    volume: int = 0  # elements this rank has handed to allreduces
    _buckets: list[_Bucket] = field(default_factory=list)
    _owner: dict[int, _Bucket] = field(default_factory=dict)
    _in_flight: list[Any] = field(default_factory=list)
    _built: bool = False

    def prepare(self, groups: Groups) -> None:
        """Zeroed bucket views as the gradients of each group's parameters (model order),
        once per step; ``groups`` are ``(communicator, parameters)``."""
        if not self._built:
            for comm, params in groups:
                if comm is not None and comm.Get_size() > 1:
                    self._build(comm, list(params)[::-1])
            self._built = True
        for bucket in self._buckets:
            bucket.buffer.fill(0)
            bucket.ready = 0
            start = 0
            for param in bucket.params:
                param.grad = bucket.buffer[start:start + param.data.size].reshape(param.shape)
                start += param.data.size

    def _build(self, comm: Any, params: list[Parameter]) -> None:
        for group in plan_buckets(params, self.bucket_mb * 2**20):
            dtype = np.result_type(*[p.data.dtype for p in group])
            xp = array_module(group[0].data)  # the buckets live with the parameters
            buffer = xp.zeros(sum(p.data.size for p in group), dtype=dtype)
            bucket = _Bucket(comm, group, buffer)
            self._buckets.append(bucket)
            self._owner.update({id(p): bucket for p in group})

    def on_grad_ready(self, layer: Layer) -> None:
        """Count ``layer``'s parameters as final; start each bucket that is complete."""
        for param in layer.params.values():
            bucket = self._owner.get(id(param))
            if bucket is None:  # reduced over one rank: nothing to do
                continue
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        self.volume += bucket.buffer.size
        with self.timers.phase("allreduce"):
            self._in_flight.append(self.transport.iallreduce(bucket.comm, bucket.buffer))

    def finish(self) -> None:
        """Wait for every bucket; the gradients then hold the sums over their groups."""
        incomplete = [b for b in self._buckets if b.ready != len(b.params)]
        if incomplete:
            raise RuntimeError(f"{len(incomplete)} gradient bucket(s) never completed: a "
                               "layer with parameters did not report its gradients")
        with self.timers.phase("allreduce"):
            self.transport.wait(self._in_flight)
        self._in_flight = []
