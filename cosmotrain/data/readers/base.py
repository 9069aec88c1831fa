"""What every reader delivers: this rank's block of a global batch, all targets, I/O counters.

A reader serves one split.  ``reader.batch(epoch, index)`` is collective over the
reader's communicator (every rank asks for the same batch) and returns a :class:`Batch`:

- ``x``: this rank's block of the (B', C, W, W, W) input, a float32 :class:`DistTensor` cut
  like ``Distribution((B', C, W, W, W), ways)`` at the rank's ``coord``, transformed; or,
  when the reader ``keep_stored`` int16 counts for a device, those counts untransformed,
  with ``device_transform`` saying what the device still applies;
- ``targets``: float32 ``[B', 4]`` labels of the *whole* global batch (the loss needs them);
- ``indices``: the global sample indices of the batch's rows, in row order.

The batches of an epoch come from ``order.epoch_batches`` and so do not depend on the rank
layout (global shuffle).  ``stats`` counts the time the caller waited for data and the
bytes read from files and received from other ranks, so the trainer can log I/O.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from cosmotrain.config.schema import Config
from cosmotrain.data.readers import order
from cosmotrain.data.dataset.manifest import Manifest
from cosmotrain.data.readers.placement import BlockPlacement
from cosmotrain.data.readers.transform import (DeviceTransform, apply_transform,
                                                mean_divisors)
from cosmotrain.tensor.dist_tensor import DistTensor


@dataclass
class Batch:
    """One global batch as seen by one rank."""

    x: DistTensor
    targets: np.ndarray
    indices: np.ndarray
    epoch: int
    index: int
    # set when ``x`` holds the stored int16 counts and the device applies the transform
    device_transform: DeviceTransform | None = None


@dataclass
class IOStats:
    """Cumulative and last-batch I/O counters of a reader (for the trainer's metrics).

    ``wait_seconds``: time ``batch()`` kept the caller waiting (with prefetch, only what
    the background read did not hide).  ``read_seconds``: time spent reading files,
    wherever it ran.  ``bytes_read``: bytes read from files; ``bytes_received``: bytes
    received from other ranks.  ``load_*``: the preload pass before the first epoch.
    """

    batches: int = 0
    wait_seconds: float = 0.0
    read_seconds: float = 0.0
    bytes_read: int = 0
    bytes_received: int = 0
    last_wait_seconds: float = 0.0
    last_bytes_read: int = 0
    last_bytes_received: int = 0
    load_seconds: float = 0.0
    load_bytes: int = 0

    def record(self, wait: float, read_seconds: float, bytes_read: int,
               bytes_received: int) -> None:
        self.batches += 1
        self.wait_seconds += wait
        self.read_seconds += read_seconds
        self.bytes_read += bytes_read
        self.bytes_received += bytes_received
        self.last_wait_seconds, self.last_bytes_read = wait, bytes_read
        self.last_bytes_received = bytes_received

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def reset(self) -> None:
        """Zero the per-batch counters (the load figures are kept)."""
        load = (self.load_seconds, self.load_bytes)
        for item in fields(self):
            setattr(self, item.name, item.default)
        self.load_seconds, self.load_bytes = load


@dataclass
class Delivery:
    """What a reader's ``_deliver`` hands back: raw rows and what it cost."""

    raw: np.ndarray  # (rows, c, d, h, w) in the stored dtype (or float32)
    read_seconds: float = 0.0
    bytes_read: int = 0
    bytes_received: int = 0
    transformed: bool = False  # raw is already float32 with the transform applied


class Reader(ABC):
    """Base of the preload and direct readers: order, geometry, targets, transform, stats."""

    def __init__(self, cfg: Config, manifest: Manifest, split: str, comm: Any,
                 placement: BlockPlacement, shuffle: bool = True) -> None:
        self.manifest, self.split, self.comm, self.placement = manifest, split, comm, placement
        self.count = manifest.count(split)
        self.batch_size = cfg.train.batch_size
        self.seed = cfg.train.seed
        self.shuffle = shuffle
        self.shards = placement.groups if cfg.data.shuffle == "local" else 1
        self.drop_last = cfg.data.drop_last and split == "train"  # validation sees all
        self.transform = cfg.data.transform
        self.stats = IOStats()
        # the job runs on a device: int16 counts leave untransformed (engine/input_stage.py)
        self.keep_stored = False
        self._order: tuple[int, list[np.ndarray]] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return order.num_batches(self.count, self.batch_size, self.drop_last)

    def indices(self, epoch: int, index: int) -> np.ndarray:
        """Global sample indices of batch ``index`` of ``epoch`` (the same on every rank)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, order.epoch_batches(
                self.seed, epoch, self.count, self.batch_size, shuffle=self.shuffle,
                shards=self.shards, drop_last=self.drop_last))
        batches = self._order[1]
        if not 0 <= index < len(batches):
            raise IndexError(f"batch {index} is outside the {len(batches)} batches of an epoch")
        return batches[index]

    def batch(self, epoch: int, index: int) -> Batch:
        """This rank's block of global batch ``index`` of ``epoch`` (collective)."""
        start = time.perf_counter()
        indices = self.indices(epoch, index)
        delivery = self._deliver(epoch, index, indices)
        x = self._finish(delivery, indices)
        self.stats.record(time.perf_counter() - start, delivery.read_seconds,
                          delivery.bytes_read, delivery.bytes_received)
        return Batch(x, self.manifest.targets(self.split, indices), indices, epoch, index,
                     self._device_transform(indices))

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """Every batch of ``epoch`` in order."""
        for index in range(self.batches_per_epoch):
            yield self.batch(epoch, index)

    def next_key(self, epoch: int, index: int) -> tuple[int, int]:
        """The batch after ``(epoch, index)``: what a prefetch should fetch."""
        return (epoch, index + 1) if index + 1 < self.batches_per_epoch else (epoch + 1, 0)

    def my_rows(self, indices: np.ndarray) -> np.ndarray:
        """The sample indices of the rows this rank's sample group holds."""
        start, stop = self.placement.rows(len(indices))
        return indices[start:stop]

    @property
    def stored_on_device(self) -> bool:
        """Whether batches leave as the stored int16 counts, for the device to transform
        (``keep_stored``; float data are transformed here whatever the device)."""
        return self.keep_stored and np.dtype(self.manifest.volume.dtype) == np.int16

    def transformed(self, raw: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float32 blocks of ``rows`` (sample indices) from their stored values."""
        means = (self.manifest.sample_means(self.split, rows)
                 if self.transform == "mean" else None)
        return apply_transform(raw, self.transform, means)

    def close(self) -> None:
        """Release what the reader holds (threads, communicators)."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish(self, delivery: Delivery, indices: np.ndarray) -> DistTensor:
        dist = self.placement.distribution(len(indices))
        if self.stored_on_device:
            return DistTensor(np.ascontiguousarray(delivery.raw, dtype=np.int16), dist,
                              self.placement.coord)
        data = delivery.raw if delivery.transformed else \
            self.transformed(delivery.raw, self.my_rows(indices))
        return DistTensor(np.ascontiguousarray(data, dtype=np.float32), dist,
                          self.placement.coord)

    def _device_transform(self, indices: np.ndarray) -> DeviceTransform | None:
        """What the device still has to do to a kept batch (None: nothing kept)."""
        if not self.stored_on_device:
            return None
        rows = self.my_rows(indices)
        divisors = (mean_divisors(self.manifest.sample_means(self.split, rows))
                    if self.transform == "mean" else None)
        return DeviceTransform(self.transform, divisors)

    @abstractmethod
    def _deliver(self, epoch: int, index: int, indices: np.ndarray) -> Delivery:
        """This rank's rows of the batch (collective): from the store or from the files."""
