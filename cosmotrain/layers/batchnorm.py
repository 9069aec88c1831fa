"""Batch normalisation with statistics reduced over the ranks that share them.

The per-channel sums (forward: sum, sum of squares, count; backward: sum of dy and of
dy * xhat) are allreduced over ``comm``, so every rank normalises with the statistics of
the whole group.  Which ranks form the group is the ``parallel.bn_statistics`` choice:

* ``global`` (default): the data group, every sample and every spatial block of the
  mini-batch: exactly the single-process function, at any rank layout;
* ``local``: the spatial group only, the blocks of one sample group's share of the batch:
  what a data-parallel framework without synchronised batch norm computes.

The parameter gradients stay this rank's partial sums (reduced with every other
gradient), see :class:`~cosmotrain.nn.layers.BatchNorm3d`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosmotrain.runtime.timers import PhaseTimers
from cosmotrain.comm.transport import Transport, make_transport
from cosmotrain.layers.blockwise import OnBlocks
from cosmotrain.layers.shards import Shard
from cosmotrain.nn.layers import BatchNorm3d
from cosmotrain.nn.module import Parameter


@dataclass
class DistBatchNorm3d(BatchNorm3d):
    """:class:`BatchNorm3d` on local arrays whose sums are allreduced over ``comm``."""

    comm: Any = None
    timers: PhaseTimers = field(default_factory=PhaseTimers)
    shard: Shard | None = None  # my channels, when channels are split (params and buffers)
    transport: Transport = field(default_factory=make_transport)  # device sums
    _GUARDS_EMPTY_GROUPS = True  # see _update_running

    def reduce_sums(self, sums: Any) -> Any:
        if self.comm is not None and self.comm.Get_size() > 1:
            with self.timers.phase("allreduce"):
                self.transport.allreduce(self.comm, sums)
        return sums

    def _update_running(self, mean: Any, var: Any) -> None:
        """The serial rule, unless the group saw no sample: then there is nothing to
        average in (its statistics would be 0 / 0) and the running ones stay as they are.

        Only ``bn_statistics: local`` meets it, on a sample group left empty by a short
        batch (fewer samples than groups); the global statistics always count a sample.
        On a device the count is a device scalar (``bn_count``): the new statistics are
        stored only where it is not 0, without the host reading it.
        """
        if not isinstance(self._count, float):
            self._store_running(self._running_values(mean, var), where=self._count > 0)
            self.buffers["num_batches_tracked"] = self.buffers["num_batches_tracked"] + 1
        elif self._count > 0:
            super()._update_running(mean, var)
        else:
            self.buffers["num_batches_tracked"] = self.buffers["num_batches_tracked"] + 1


@dataclass
class SpatialBatchNorm3d(OnBlocks, DistBatchNorm3d):
    """:class:`DistBatchNorm3d` on the spatial blocks of :class:`DistTensor` inputs."""


def dist_batchnorm(layer: BatchNorm3d, comm: Any, timers: PhaseTimers,
                   spatial: bool, transport: Transport | None = None) -> DistBatchNorm3d:
    """The distributed twin of ``layer`` (same parameters and running statistics)."""
    cls = SpatialBatchNorm3d if spatial else DistBatchNorm3d
    return cls(name=layer.name, params=layer.params, buffers=layer.buffers,
               needs_input_grad=layer.needs_input_grad, channels=layer.channels,
               eps=layer.eps, momentum=layer.momentum, comm=comm, timers=timers,
               transport=transport or make_transport())


def channel_batchnorm(layer: BatchNorm3d, comm: Any, timers: PhaseTimers,
                      channels: tuple[int, int],
                      transport: Transport | None = None) -> SpatialBatchNorm3d:
    """The twin of ``layer`` for the fine channel block ``[start, stop)`` only.

    Its parameters and running statistics are copies of that block (the full arrays are
    dropped with the serial model); the statistics are reduced over ``comm``, whose ranks
    all hold the same channels.
    """
    shard = Shard((layer.channels,), (slice(*channels),))
    params = {key: Parameter(shard.take(p.data), shard) for key, p in layer.params.items()}
    buffers = {key: shard.take(value) if getattr(value, "ndim", 0) else value
               for key, value in layer.buffers.items()}
    return SpatialBatchNorm3d(name=layer.name, params=params, buffers=buffers,
                              needs_input_grad=layer.needs_input_grad,
                              channels=channels[1] - channels[0], eps=layer.eps,
                              momentum=layer.momentum, comm=comm, timers=timers, shard=shard,
                              transport=transport or make_transport())
