"""The direct reader: every step each rank reads its own block of its rows from the files.

A rank reads, for each row of its sample group, the hyperslab (channel block x spatial
block) of that sample's cube with h5py, so the ranks of a sample group read disjoint
bytes and nobody reads a whole sample.  Replicas of a block (ranks differing only along
axes the input is not split along) do not read it twice: the first reads, the others get
it by ``Bcast``.  With ``data.prefetch`` a background thread reads (and transforms) the
next batch while the caller computes; ``stats.wait_seconds`` is then what it did not hide.
Nothing is held between steps, so any dataset size works (``data.reader: direct``).
A bad file (unreadable, or holding NaN/Inf or values the transform cannot take) met by
any rank is raised on every rank alike (one small allreduce per batch), so the job ends
with one message and exit code 2 even when several ranks read blocks of that file.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from cosmotrain.comm.collective import together
from cosmotrain.config.schema import Config
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.dataset.manifest import Manifest
from cosmotrain.data.readers.placement import BlockPlacement, RankTable
from cosmotrain.data.readers.prefetch import Prefetcher
from cosmotrain.data.readers.base import Delivery, Reader
from cosmotrain.data.readers.transform import check_domain


class DirectReader(Reader):
    """Reads every batch from the files (``data.reader: direct``); collective per batch."""

    def __init__(self, cfg: Config, manifest: Manifest, split: str, comm: Any,
                 placement: BlockPlacement, shuffle: bool = True,
                 prefetch: bool | None = None) -> None:
        super().__init__(cfg, manifest, split, comm, placement, shuffle)
        table = RankTable.gather(comm, placement)
        self.replicas = None
        if table.replicas > 1:
            self.replicas = comm.Split(table.index(placement.coord), comm.Get_rank())
        self.reads = self.replicas is None or self.replicas.Get_rank() == 0
        wanted = cfg.data.prefetch if prefetch is None else prefetch
        self.prefetcher: Prefetcher[Delivery] | None = \
            Prefetcher() if wanted and self.reads else None

    def read_rows(self, indices: np.ndarray) -> Delivery:
        """Read and transform this rank's blocks of a batch (runs in the prefetch thread)."""
        rows = self.my_rows(indices)
        start = time.perf_counter()
        raw = np.empty((len(rows),) + self.placement.block_shape,
                       dtype=self.manifest.volume.dtype)
        for k, sample in enumerate(rows):
            path, origin = self.manifest.locate(self.split, int(sample))
            formats.read_block(path, self.manifest.volume, self.placement.box, origin,
                               self.placement.channel_slice, out=raw[k])
            check_domain(path, raw[k], self.transform, self.manifest.volume.volume_name)
        seconds = time.perf_counter() - start
        if self.stored_on_device:  # the device transforms it (Reader.keep_stored)
            return Delivery(raw, seconds, raw.nbytes)
        return Delivery(self.transformed(raw, rows), seconds, raw.nbytes, transformed=True)

    def close(self) -> None:
        """Stop the prefetch thread and free the replica communicator (collective)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        if self.replicas is not None:
            self.replicas.Free()
            self.replicas = None

    def _deliver(self, epoch: int, index: int, indices: np.ndarray) -> Delivery:
        delivery = together(self.comm, lambda: self._own_part(epoch, index, indices))
        if self.replicas is not None:
            self.replicas.Bcast(delivery.raw, root=0)
            if not self.reads:
                delivery.bytes_received = delivery.raw.nbytes
        return delivery

    def _own_part(self, epoch: int, index: int, indices: np.ndarray) -> Delivery:
        """My rows as read, or an empty buffer for the replica Bcast to fill."""
        if self.reads:
            return self._fetch(epoch, index, indices)
        rows = self.placement.rows(len(indices))
        shape = (rows[1] - rows[0],) + self.placement.block_shape
        if self.stored_on_device:
            return Delivery(np.empty(shape, dtype=np.int16))
        return Delivery(np.empty(shape, dtype=np.float32), transformed=True)

    def _fetch(self, epoch: int, index: int, indices: np.ndarray) -> Delivery:
        if self.prefetcher is None:
            return self.read_rows(indices)
        delivery = self.prefetcher.get((epoch, index), lambda: self.read_rows(indices))
        following = self.next_key(epoch, index)
        upcoming = self.indices(*following)
        self.prefetcher.schedule(following, lambda: self.read_rows(upcoming))
        return delivery
