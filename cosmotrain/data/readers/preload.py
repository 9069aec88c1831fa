"""The preload reader: the split read once into the job's memory, then served by MPI.

LBANN's Conduit data store, for blocks.  Before the first epoch every unit (sample,
channel block, spatial block) of the split is read by exactly one rank, its *owner*, with
one hyperslab read, and kept in the stored dtype (int16 stays int16).  A unit's owner is
a rank holding that same (channel, spatial) block, in the sample's *home* group:

- global shuffle: home group ``s % groups``; the store is spread evenly over the job;
- local shuffle: the group whose fixed shard holds ``s``, so every exchange stays inside
  the sample group (usually one node).

Replicas of a block (ranks that differ only along axes the input is not split along)
take turns: replica ``(s // groups) % replicas`` owns ``s``.  Every step, the ranks
holding one (channel, spatial) block swap the blocks of the batch's rows in one
``Alltoallw`` whose datatypes pick the blocks straight out of the store and drop them
straight into the rows (no packing copies); the receiver then applies the transform.
Owners and the order are fixed by (seed, epoch), not by timing, so the result is
deterministic.  A bad file (unreadable, or holding NaN/Inf or values the transform cannot
take) met by any rank during the read is raised on every rank alike: one message, exit 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cosmotrain.comm.collective import together
from cosmotrain.config.schema import Config
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.readers import order
from cosmotrain.data.dataset.manifest import Manifest
from cosmotrain.data.readers.placement import BlockPlacement, RankTable
from cosmotrain.data.readers.preload_memory import check_preload_memory
from cosmotrain.data.readers.base import Delivery, Reader
from cosmotrain.data.readers.transform import check_domain


class PreloadReader(Reader):
    """Serves batches from blocks held in memory across the job (``data.reader: preload``).

    Construction is collective and cheap; :meth:`prepare` (the memory check and the read)
    runs before the first batch, or explicitly, e.g. after a combined memory check.
    """

    def __init__(self, cfg: Config, manifest: Manifest, split: str, comm: Any,
                 placement: BlockPlacement, shuffle: bool = True) -> None:
        super().__init__(cfg, manifest, split, comm, placement, shuffle)
        self.memory_fraction = cfg.data.memory_fraction
        table = RankTable.gather(comm, placement)
        keys = sorted({coord[1:] for coord in table.coords})
        # the ranks holding my (channel, spatial) block, in rank order: the exchange group
        members = [r for r, coord in enumerate(table.coords) if coord[1:] == placement.block_key]
        self.exchange = comm.Split(keys.index(placement.block_key), comm.Get_rank())
        self.me = self.exchange.Get_rank()
        self.member_group = np.array([table.coords[r][0] for r in members])
        self.owner = self._owners(table, members)  # exchange rank owning each sample
        self.owned = np.flatnonzero(self.owner == self.me)
        self.slot = np.full(self.count, -1, dtype=np.int64)
        self.slot[self.owned] = np.arange(len(self.owned))
        self.store: np.ndarray | None = None
        self._blocktype: Any = None

    @property
    def store_bytes(self) -> int:
        """Bytes this rank's store holds once loaded."""
        return len(self.owned) * self.placement.block_size * self.manifest.itemsize

    def prepare(self, check_memory: bool = True,
                progress: Callable[[int], None] | None = None) -> None:
        """Check the memory (collective) and read this rank's units (once)."""
        if self.store is not None:
            return
        if check_memory:
            check_preload_memory(self.comm, self.store_bytes, self.memory_fraction)
        start = time.perf_counter()
        store = together(self.comm, lambda: self._read_store(progress))
        self.store = store
        self.stats.load_seconds = time.perf_counter() - start
        self.stats.load_bytes = store.nbytes
        self._blocktype = _block_datatype(store.dtype, self.placement.block_size)

    def _read_store(self, progress: Callable[[int], None] | None) -> np.ndarray:
        """Read this rank's units; a bad file raises :class:`DataError` naming it."""
        store = np.empty((len(self.owned),) + self.placement.block_shape,
                         dtype=self.manifest.volume.dtype)
        for slot, sample in enumerate(self.owned):
            path, origin = self.manifest.locate(self.split, int(sample))
            formats.read_block(path, self.manifest.volume, self.placement.box, origin,
                               self.placement.channel_slice, out=store[slot])
            check_domain(path, store[slot], self.transform,
                         self.manifest.volume.volume_name)
            if progress is not None:
                progress(slot + 1)
        return store

    def close(self) -> None:
        """Free the exchange communicator and datatype (collective), drop the store."""
        if self._blocktype is not None:
            self._blocktype.Free()
            self._blocktype = None
        if self.exchange is not None:
            self.exchange.Free()
            self.exchange = None
        self.store = None

    def _owners(self, table: RankTable, members: list[int]) -> np.ndarray:
        """Exchange rank owning each sample: its home group's replica ``s // groups``."""
        lookup = np.zeros((self.placement.groups, table.replicas), dtype=np.int64)
        for member, rank in enumerate(members):
            lookup[table.coords[rank][0], table.replica[rank]] = member
        samples = np.arange(self.count)
        return lookup[self._home_groups(), (samples // self.placement.groups) % table.replicas]

    def _home_groups(self) -> np.ndarray:
        samples = np.arange(self.count)
        groups = self.placement.groups
        if self.shards == 1:
            return samples % groups
        starts = [start for start, _ in order.shard_ranges(self.count, self.batch_size, groups)]
        return np.searchsorted(np.array(starts), samples, side="right") - 1

    def _deliver(self, epoch: int, index: int, indices: np.ndarray) -> Delivery:
        self.prepare()
        assert self.store is not None
        batch = len(indices)
        start, stop = self.placement.rows(batch)
        raw = np.empty((stop - start,) + self.placement.block_shape, dtype=self.store.dtype)
        if self.placement.block_size == 0:
            return Delivery(raw)
        row_groups = np.array(self.placement.row_groups(batch), dtype=np.int64)
        source = self.owner[indices]
        sends = [self.slot[indices[(source == self.me) & (row_groups == group)]]
                 for group in self.member_group]
        mine = source[start:stop]
        recvs = [np.flatnonzero(mine == member) for member in range(len(self.member_group))]
        send_types = [self._selection(slots) for slots in sends]
        recv_types = [self._selection(rows) for rows in recvs]
        zeros = [0] * len(sends)
        self.exchange.Alltoallw(
            [self.store, [int(len(s) > 0) for s in sends], zeros, send_types],
            [raw, [int(len(r) > 0) for r in recvs], zeros, recv_types])
        for datatype in send_types + recv_types:
            if datatype != self._blocktype:
                datatype.Free()
        foreign = len(mine) - len(recvs[self.me])
        return Delivery(raw, bytes_received=foreign * self.placement.block_size *
                        self.store.itemsize)

    def _selection(self, positions: np.ndarray) -> Any:
        """An MPI datatype picking the blocks at ``positions`` (in order) of a block array,
        so the exchange reads the store and writes the rows in place, with no packing."""
        if len(positions) == 0:
            return self._blocktype
        return self._blocktype.Create_indexed_block(1, positions.tolist()).Commit()


def _block_datatype(dtype: np.dtype, block_size: int) -> Any:
    """An MPI datatype of one block (``block_size`` values of ``dtype``), committed."""
    from mpi4py.util.dtlib import from_numpy_dtype

    if block_size == 0:
        return None
    return from_numpy_dtype(dtype).Create_contiguous(block_size).Commit()
