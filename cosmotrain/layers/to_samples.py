"""Where spatial parallelism stops: spatial blocks -> whole samples (LBANN's shuffle).

Late layers work on small volumes, where halos cost as much as the compute and the
linear layers need whole samples anyway.  This layer gathers each sample group's
partitioned activations (spatial blocks, and channel blocks when channels are split) into
whole samples *spread over the same ranks*: the group's ``Bg`` samples are cut into
balanced blocks over its ``P`` ranks (one all-to-all inside the group, ``grid``'s
``model`` communicator; a rank gets no sample when ``Bg < P``, and a group with
``Bg = 0``, left empty by a short batch, moves nothing).  Everything
after it is plain data parallelism on local samples.  Backward is the inverse all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.device.xp import array_module
from cosmotrain.nn.module import Context, Layer
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.tensor.distribution import Distribution, block_range
from cosmotrain.tensor.redistribute import Redistribution


@dataclass
class ToSamples(Layer):
    """Redistribute a :class:`DistTensor` of spatial blocks into local whole samples."""

    grid: ProcessGrid | None = None
    runtime: Runtime = field(default_factory=Runtime)  # the job's transport and timers
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def _comm(self) -> Any:
        return self.grid.group_comms["model"]  # type: ignore[union-attr]

    def sample_range(self, x_dist: Distribution, x_coord: tuple[int, ...]) -> tuple[int, int]:
        """Global batch indices ``[a, b)`` of the samples this rank holds afterwards."""
        group = x_dist.block(x_coord)[0]
        comm = self._comm
        lo, hi = block_range(group.stop - group.start, comm.Get_size(), comm.Get_rank())
        return group.start + lo, group.start + hi

    def _plan(self, x: DistTensor) -> Redistribution:
        """The all-to-all inside the sample group, over the group's own samples."""
        if x.dist not in self._plans:
            shape = x.data.shape[:1] + x.dist.global_shape[1:]
            comm = self._comm
            self._plans[x.dist] = Redistribution.plan(
                comm, Distribution(shape, (1,) + x.dist.grid[1:]), (0,) + x.coord[1:],
                Distribution(shape, (comm.Get_size(), 1, 1, 1, 1)),
                (comm.Get_rank(), 0, 0, 0, 0), self.runtime.transport)
        return self._plans[x.dist]

    def forward(self, x: DistTensor, ctx: Context) -> Any:
        self._x = (x.dist, x.coord)
        if self._comm.Get_size() == 1:
            return x.data
        if _group_empty(x.dist, x.coord):
            return array_module(x.data).zeros((0,) + x.dist.global_shape[1:], x.data.dtype)
        with self.runtime.timers.phase("redistribution"):
            return self._plan(x)(x.data)

    def backward(self, dy: Any, ctx: Context) -> DistTensor | None:
        dist, coord = self._x
        if not self.needs_input_grad:
            return None
        if self._comm.Get_size() == 1:
            return DistTensor(dy, dist, coord)
        if _group_empty(dist, coord):
            return DistTensor(array_module(dy).zeros(dist.local_shape(coord), dy.dtype),
                              dist, coord)
        with self.runtime.timers.phase("redistribution"):
            return DistTensor(self._plans[dist].reverse()(dy), dist, coord)


def _group_empty(dist: Distribution, coord: tuple[int, ...]) -> bool:
    """Whether my sample group holds no sample of the batch (a short batch: fewer samples
    than sample groups).

    Then it has nothing to redistribute.  Every rank of the ``model`` communicator shares
    my sample coordinate, so all of them skip the all-to-all together, and no rank
    waits on another: skipping it on some ranks only would hang.
    """
    return dist.local_shape(coord)[0] == 0
