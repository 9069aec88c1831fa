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

With ``shard`` (``parallel.shard_optimizer``, ZeRO-2 style) each bucket is cut into R
balanced contiguous ranges, range ``r`` belonging to rank ``r`` of its group
(:func:`~cosmotrain.tensor.distribution.block_range` of the bucket's size: a function of
the parameter sizes, ``bucket_mb`` and R only).  A bucket is then *reduce-scattered* in
place instead of allreduced, and once that has completed (looked at whenever a layer
reports, so while backward goes on) the rank copies its range of the sums out
(:attr:`Bucket.shard`) and drops the buffer: the full gradient of a bucket is held only
from :meth:`~GradientReducer.prepare` to its reduction, not through the rest of backward
(where a step's memory peaks) nor between steps, and ``param.grad`` of a bucketed
parameter is None afterwards.  The sharded optimizer (``engine/optim_shards.py``) updates the range
and hands the new values to :meth:`GradientReducer.start_gather`, whose all-gather puts
every rank's range into every rank's parameters (:meth:`finish_gather`): a
reduce-scatter and an all-gather move what one allreduce moves.  The shard is copied into
an array of the bucket's own, allocated once (:meth:`Bucket.keep_shard`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.runtime.timers import PhaseTimers
from cosmotrain.device import step_memory
from cosmotrain.device.pages import PageBuffer
from cosmotrain.comm.transport import Transport, make_transport
from cosmotrain.device.xp import array_module
from cosmotrain.nn.module import Layer, Parameter
from cosmotrain.tensor.distribution import block_range

DEFAULT_BUCKET_MB = 25.0  # as PyTorch DDP


@dataclass(frozen=True)
class Piece:
    """Where a bucket's shard meets one parameter: the flat elements ``[lo, hi)`` of
    ``param`` are elements ``[at, at + hi - lo)`` of the shard (possibly none)."""

    param: Parameter
    lo: int
    hi: int
    at: int

    @property
    def span(self) -> slice:
        """The piece's elements within the shard."""
        return slice(self.at, self.at + self.hi - self.lo)


@dataclass(eq=False)  # compared by identity: it holds arrays
class Bucket:
    """The flat gradient buffer of ``params`` (``size`` elements), reduced over ``comm``.

    ``counts``: the elements of each rank's range when sharded (empty otherwise).  The
    buffer is persistent when the bucket is allreduced; a sharded bucket's is held only
    from :meth:`GradientReducer.prepare` until its reduce-scatter completes, when its
    range of the sums is kept as :attr:`shard` and the buffer dropped (on the host its
    pages go back to the OS: :class:`~cosmotrain.device.pages.PageBuffer`), and again
    for the all-gather of the new parameters."""

    comm: Any
    params: list[Parameter]
    size: int
    dtype: Any
    xp: Any  # the array module of the parameters: the buffer lives with them
    counts: list[int] = field(default_factory=list)
    buffer: Any = None
    shard: Any = None  # this rank's range of the reduced gradient (sharded, after finish)
    ready: int = 0
    _pages: PageBuffer | None = field(default=None, repr=False)
    _kept: Any = field(default=None, repr=False)  # the array :attr:`shard` lives in

    def allocate(self, zero: bool = True) -> None:
        """A buffer for this step's use (zeroed unless ``zero`` is false): on the host the
        bucket's own pages, on a device a block of the array module's pool.

        On the host under planned step memory (:mod:`cosmotrain.device.step_memory`) it
        is an ordinary array, placed by the plan among the step's other arrays: the
        gradient buffer from :meth:`GradientReducer.prepare` to its reduce-scatter, the
        all-gather's in the update, where the activations were.  Pages of its own (the
        heap alone) sit beside the step's peak instead: W = 256, D2H2, every bucket's
        36 MiB at once in the all-gather."""
        if self.xp is not np or step_memory.planning():
            self.buffer = (self.xp.zeros if zero else self.xp.empty)(self.size,
                                                                      dtype=self.dtype)
            return
        if self._pages is None:
            self._pages = PageBuffer(self.size, self.dtype)
        self.buffer = self._pages.zeros() if zero else self._pages.written()

    def keep_shard(self) -> None:
        """Keep this rank's range of the reduced buffer (an in-place reduce-scatter leaves
        it at the buffer's start) as :attr:`shard`, and drop the buffer.

        The shard's array is allocated once and reused every step.  A new one each step
        was allocated when the reduce-scatter was seen complete, a moment the ranks'
        timing sets; on the host that moved glibc's heap layout from run to run, and the
        peak resident memory of identical W=256 D2H2 steps with it (870 or 897 MiB).
        """
        count = self.span[1] - self.span[0]
        if self._kept is None:
            self._kept = self.xp.empty(count, dtype=self.dtype)
        self._kept[...] = self.buffer[:count]
        self.shard = self._kept
        self.drop()

    def drop(self) -> None:
        """Let the buffer go: its pages back to the OS, or its block back to the pool."""
        self.buffer = None
        if self._pages is not None:
            self._pages.release()

    @property
    def span(self) -> tuple[int, int]:
        """This rank's range ``[a, b)`` of the buffer (sharded buckets)."""
        rank = self.comm.Get_rank()
        start = sum(self.counts[:rank])
        return start, start + self.counts[rank]

    def pieces(self) -> list[Piece]:
        """Every parameter's part of this rank's range, in buffer order (empty parts
        included, so every rank lists every parameter)."""
        a, b = self.span
        out, offset = [], 0
        for param in self.params:
            start, stop = max(a, offset), min(b, offset + param.data.size)
            out.append(Piece(param, start - offset, stop - offset, start - a)
                       if start < stop else Piece(param, 0, 0, 0))
            offset += param.data.size
        return out

    def views(self) -> None:
        """Make every parameter's gradient its view of the buffer."""
        start = 0
        for param in self.params:
            param.grad = self.buffer[start:start + param.data.size].reshape(param.shape)
            start += param.data.size

    def unpack(self) -> None:
        """Copy the buffer's values into the parameters."""
        start = 0
        for param in self.params:
            param.data[...] = self.buffer[start:start + param.data.size].reshape(param.shape)
            start += param.data.size


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
    """Sums parameter gradients over their groups in buckets of about ``bucket_mb`` MiB
    (with ``shard``: reduce-scatters them, see the module docstring)."""

    timers: PhaseTimers
    bucket_mb: float = DEFAULT_BUCKET_MB
    transport: Transport = field(default_factory=make_transport)  # device buckets
    shard: bool = False
    volume: int = 0  # elements this rank has handed to gradient reductions
    _buckets: list[Bucket] = field(default_factory=list)
    _owner: dict[int, Bucket] = field(default_factory=dict)
    _in_flight: list[Any] = field(default_factory=list)
    _built: bool = False

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order (empty until :meth:`build`)."""
        return self._buckets

    def owns(self, param: Parameter) -> bool:
        """Whether ``param``'s gradient is reduced in a bucket (its group has R > 1)."""
        return id(param) in self._owner

    def build(self, groups: Groups) -> None:
        """Plan and allocate the buckets of ``groups`` (``(communicator, parameters)``,
        parameters in model order), once; later calls do nothing."""
        if not self._built:
            for comm, params in groups:
                if comm is not None and comm.Get_size() > 1:
                    self._build(comm, list(params)[::-1])
            self._built = True

    def prepare(self, groups: Groups) -> None:
        """Zeroed bucket views as the gradients of each group's parameters (model order),
        once per step (:meth:`build` on the first).  A sharded bucket's buffer is new each
        step: its pages cost memory only once gradients land in them."""
        self.build(groups)
        for bucket in self._buckets:
            if self.shard:
                bucket.allocate()
                bucket.shard = None
            else:
                bucket.buffer.fill(0)
            bucket.ready = 0
            bucket.views()

    def _build(self, comm: Any, params: list[Parameter]) -> None:
        ranks = comm.Get_size()
        for group in plan_buckets(params, self.bucket_mb * 2**20):
            size = sum(p.data.size for p in group)
            counts = [hi - lo for lo, hi in (block_range(size, ranks, r)
                                             for r in range(ranks))] if self.shard else []
            bucket = Bucket(comm, group, size, np.result_type(*[p.data.dtype for p in group]),
                            array_module(group[0].data), counts)
            if not self.shard:
                bucket.buffer = bucket.xp.zeros(size, dtype=bucket.dtype)
            self._buckets.append(bucket)
            self._owner.update({id(p): bucket for p in group})

    def on_grad_ready(self, layer: Layer) -> None:
        """Count ``layer``'s parameters as final; start each bucket that is complete (and,
        sharded, keep the shards of the reduce-scatters that have completed)."""
        for param in layer.params.values():
            bucket = self._owner.get(id(param))
            if bucket is None:  # reduced over one rank: nothing to do
                continue
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)
        if self.shard:
            self._wait(done_only=True)

    def _launch(self, bucket: Bucket) -> None:
        self.volume += bucket.size
        with self.timers.phase("allreduce"):
            pending = self.transport.ireduce_scatter(bucket.comm, bucket.buffer,
                                                     bucket.counts) if self.shard else \
                self.transport.iallreduce(bucket.comm, bucket.buffer)
            self._in_flight.append((bucket, pending))

    def finish(self) -> None:
        """Wait for every bucket; the gradients then hold the sums over their groups (with
        ``shard``: each bucket's :attr:`~Bucket.shard` holds this rank's range of them)."""
        incomplete = [b for b in self._buckets if b.ready != len(b.params)]
        if incomplete:
            raise RuntimeError(f"{len(incomplete)} gradient bucket(s) never completed: a "
                               "layer with parameters did not report its gradients")
        self._wait()

    def _wait(self, done_only: bool = False) -> None:
        """Complete the operations in flight (only those already done: ``done_only``); a
        completed reduce-scatter keeps its shard and drops its buffer."""
        with self.timers.phase("allreduce"):
            finished = [not done_only or self.transport.test(p) for _, p in self._in_flight]
            done = [item for item, end in zip(self._in_flight, finished) if end]
            self.transport.wait([p for _, p in done])
        self._in_flight = [item for item, end in zip(self._in_flight, finished) if not end]
        for bucket, _ in done:
            if self.shard and bucket.shard is None:
                bucket.keep_shard()
                for param in bucket.params:
                    param.grad = None  # views of a buffer that is gone

    def reduced_gradients(self, params: Iterable[Parameter]) -> list[Any]:
        """The reduced gradients this rank holds after :meth:`finish`: every gradient, or
        with ``shard`` the buckets' shards and the unbucketed parameters' gradients."""
        if not self.shard:
            return [p.grad for p in params]
        return [b.shard for b in self._buckets] + \
            [p.grad for p in params if not self.owns(p)]

    def start_gather(self, bucket: Bucket, values: Any) -> None:
        """Start sending this rank's new parameter ``values`` (its range of ``bucket``) to
        every rank of the group; :meth:`finish_gather` completes all of them."""
        a, b = bucket.span
        bucket.allocate(zero=False)
        bucket.buffer[a:b] = values
        with self.timers.phase("allreduce"):
            self._in_flight.append((bucket, self.transport.iallgatherv(
                bucket.comm, bucket.buffer, bucket.counts)))

    def finish_gather(self) -> None:
        """Wait for the gathers and copy every bucket's new values into its parameters."""
        self._wait()
        for bucket in self._buckets:
            bucket.unpack()
            bucket.drop()
            bucket.shard = None
