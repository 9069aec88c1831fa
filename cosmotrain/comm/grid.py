"""ProcessGrid: a Cartesian communicator over a ``Layout``'s axes (sample ... width).

Ranks are laid out row-major with ``sample`` slowest, so the spatial blocks of one sample
(and its channel/filter groups) are consecutive ranks: with block placement by the
launcher they share a node, and the halo traffic stays on it.  Every sub-communicator a
layer may need is created up front, collectively, so no rank can ever wait in a ``Sub``
that another rank skipped.

The grid is pure topology and immutable once built: how buffers cross MPI (the
transport) and the communication timers belong to the job's
:class:`~cosmotrain.runtime.job_runtime.Runtime`.  The one cache it keeps, the channel/filter
communicators per factorisation, is filled collectively and never replaced.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from cosmotrain.config.layout import AXES, SPATIAL, Layout

# Groups of axes with a sub-communicator each: ranks that differ only along these axes.
GROUPS = {
    "spatial": SPATIAL,  # the blocks of one sample (same sample, channel, filter)
    "data": ("sample",) + SPATIAL,  # replicas of an unsplit parameter's block
    "channel_filter": ("channel", "filter"),  # the weight blocks of one layer
    "model": ("channel", "filter") + SPATIAL,  # one sample group's shards and blocks
    "all": AXES,  # replicas of a parameter that no axis splits (the data-parallel head)
}


class ProcessGrid:
    """The job's ranks as a 6-D Cartesian grid, with its sub-communicators."""

    def __init__(self, comm: Any, layout: Layout) -> None:
        self.shape = layout.ways
        if comm.Get_size() != layout.size:
            raise ValueError(f"the grid {layout.describe()} needs {layout.size} "
                             f"ranks, the communicator has {comm.Get_size()}")
        self.layout = layout
        self.cart = comm.Create_cart(list(self.shape), periods=[False] * len(AXES),
                                     reorder=False)
        self.rank = self.cart.Get_rank()
        self.coords = tuple(self.cart.Get_coords(self.rank))
        self.axis_comms = {axis: self._sub((axis,)) for axis in AXES}
        self.group_comms = {name: self._sub(axes) for name, axes in GROUPS.items()}
        self._factor_comms: dict[Any, tuple[Any, Any]] = {}
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"ProcessGrid is immutable: cannot set {name!r}")
        object.__setattr__(self, name, value)

    def _sub(self, axes: Sequence[str]) -> Any:
        return self.cart.Sub([axis in axes for axis in AXES])

    def coord(self, axis: str) -> int:
        return self.coords[AXES.index(axis)]

    def ways(self, axis: str) -> int:
        return self.shape[AXES.index(axis)]

    @property
    def spatial_coords(self) -> tuple[int, int, int]:
        return tuple(self.coord(axis) for axis in SPATIAL)  # type: ignore[return-value]

    @property
    def spatial_shape(self) -> tuple[int, int, int]:
        return tuple(self.ways(axis) for axis in SPATIAL)  # type: ignore[return-value]

    def spatial_neighbour(self, offset: Sequence[int]) -> int | None:
        """Rank (in ``cart``) at ``offset`` in (depth, height, width), None off the grid."""
        coords = list(self.coords)
        for axis, step in zip(SPATIAL, offset):
            i = AXES.index(axis)
            coords[i] += step
            if not 0 <= coords[i] < self.shape[i]:
                return None
        return self.cart.Get_cart_rank(coords)

    def spatial_offsets(self) -> Iterator[tuple[int, int, int]]:
        """The 26 neighbour offsets in {-1, 0, 1}^3 minus the origin (fixed order)."""
        for offset in itertools.product((-1, 0, 1), repeat=3):
            if any(offset):
                yield offset  # type: ignore[misc]

    def channel_filter_comms(self, factor: Any) -> tuple[Any, Any]:
        """``(channel_comm, filter_comm)`` of a ``c x f`` factorisation of my channel/filter
        group (``channel_split.Factor``), created once per factorisation (collective: every
        rank builds the same layers in the same order).

        With group rank ``j = ic * f + if``, ``channel_comm`` holds the ``c`` ranks sharing
        ``if`` (ordered by ``ic``) and ``filter_comm`` the ``f`` ranks sharing ``ic``.
        """
        if factor not in self._factor_comms:
            group = self.group_comms["channel_filter"]
            ic, if_ = divmod(group.Get_rank(), factor.filter)
            self._factor_comms[factor] = (group.Split(if_, ic), group.Split(ic, if_))
        return self._factor_comms[factor]

    def sum_all(self, values: Any) -> Any:
        """``values`` (a float64 host array) summed over every rank of the job, in place;
        returned for convenience.  The loss and the guards' votes ride in it
        (:func:`cosmotrain.layers.loss.loss_and_sums`): layers never call MPI themselves."""
        comm = self.group_comms["all"]
        if comm.Get_size() > 1:
            from mpi4py import MPI

            comm.Allreduce(MPI.IN_PLACE, values)
        return values

    def free(self) -> None:
        """Release the communicators (collective)."""
        pairs = [comm for pair in self._factor_comms.values() for comm in pair]
        for comm in [*pairs, *self.axis_comms.values(), *self.group_comms.values(),
                     self.cart]:
            comm.Free()
