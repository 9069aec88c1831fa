"""Build the readers a job needs from its config: manifest, placement, reader per split.

    manifest = open_dataset(cfg, comm)
    dist, coord = step.model.input_distribution((cfg.train.batch_size, C, W, W, W))
    readers = make_readers(cfg, manifest, comm, BlockPlacement.from_distribution(dist, coord))
    for batch in readers["train"].epoch(epoch): ...

Everything here is collective over ``comm`` (every rank of the job calls it alike).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cosmotrain.config.schema import Config
from cosmotrain.data.formats import interface as formats, tfrecord as tfrecord_sample
from cosmotrain.data.readers.direct import DirectReader
from cosmotrain.data.dataset.manifest import Manifest, open_manifest
from cosmotrain.data.readers.placement import BlockPlacement
from cosmotrain.data.readers.preload import PreloadReader
from cosmotrain.data.readers.preload_memory import check_preload_memory
from cosmotrain.data.readers.base import Reader
from cosmotrain.data.dataset.verify import verify_dataset
from cosmotrain.errors import ConfigError

SYNTHETIC_SUBDIR = "data"
LOG = logging.getLogger(__name__)


def dataset_root(cfg: Config) -> Path:
    """The dataset directory: ``data.path``, or ``output.dir/data`` for synthetic data."""
    if cfg.data.source == "synthetic":
        return Path(cfg.output.dir) / SYNTHETIC_SUBDIR
    if not cfg.data.path:
        raise ConfigError("data.path", "is not set but data.source is files",
                          "set data.path to a dataset directory (cosmotrain datagen --out DIR)")
    return Path(cfg.data.path)


def open_dataset(cfg: Config, comm: Any, *, verify: bool = True) -> Manifest:
    """The manifest of the config's dataset at ``model.width``, its files checked against
    their checksums as ``data.verify`` says (``verify.py``) unless ``verify`` is False
    (staging checks each file while it copies it) (collective)."""
    if cfg.model.channels != 4:
        raise ConfigError("model.channels", f"{cfg.model.channels} does not match the 4 "
                          "channels of CosmoFlow data", "set model.channels: 4")
    manifest = open_manifest(dataset_root(cfg), cfg.model.width, comm,
                             means=cfg.data.transform == "mean", cache_dir=cfg.data.cache_dir,
                             format=cfg.data.format)
    if not verify:
        return manifest
    checked = verify_dataset(manifest.root, cfg.data.verify, comm)  # data.verify
    LOG.debug("data.verify %s: %d file(s) of '%s' match their checksums", cfg.data.verify,
              checked, manifest.root)
    return manifest


def note_compression(manifest: Manifest, comm: Any) -> None:
    """Say once (rank 0, stderr) that a dataset of gzip TFRecord files is inflated on every
    read, and how to avoid it; a dataset's files are all alike, so the first one tells."""
    if manifest.volume.format != formats.TFRECORD or comm.Get_rank() != 0:
        return
    first = next((names[0] for names in manifest.files.values() if names), None)
    if first is not None and tfrecord_sample.is_gzip(manifest.root / first):
        print(f"cosmotrain: note: the TFRecord files of '{manifest.root}' are gzip streams, "
              f"so every read inflates a whole file ({manifest.disk_width}^3 x 4 int16: "
              f"{manifest.volume_bytes / 2**20:.0f} MiB per file); stage them decompressed "
              f"once with cosmotrain preload and train from the staged copy",
              file=sys.stderr, flush=True)


def describe_reader(reader: Reader, kind: str) -> str:
    """One debug line: what this rank's reader of a split serves, and how many bytes."""
    placement, manifest = reader.placement, reader.manifest
    start, stop = placement.rows(reader.batch_size)
    block = placement.block_size * (stop - start)
    stored = (f"{reader.store_bytes / 2**20:.2f} MiB held here"
              if isinstance(reader, PreloadReader) else "read from the files every step")
    return (f"split {reader.split}: {reader.count} sample(s), {kind} reader ({stored}), "
            f"{'shuffled' if reader.shuffle else 'in order'}; this rank's block "
            f"{'x'.join(map(str, placement.block_shape))} of {stop - start} sample(s) a "
            f"batch: {block * manifest.itemsize / 2**20:.2f} MiB stored, "
            f"{block * 4 / 2**20:.2f} MiB as float32 per batch")


def make_reader(cfg: Config, manifest: Manifest, split: str, comm: Any,
                placement: BlockPlacement, *, shuffle: bool | None = None) -> Reader:
    """The reader ``data.reader`` names for one split, ready to serve (collective).

    ``shuffle`` defaults to True for ``train`` and False otherwise.
    """
    return make_readers(cfg, manifest, comm, placement, (split,),
                        shuffle={split: shuffle} if shuffle is not None else None)[split]


def make_readers(cfg: Config, manifest: Manifest, comm: Any, placement: BlockPlacement,
                 splits: Sequence[str] | None = None, *,
                 shuffle: dict[str, bool] | None = None) -> dict[str, Reader]:
    """One reader per split (default: every split of the dataset), ready to serve.

    Preload readers check the memory of all their stores together (train and validation
    are resident at once), then read them.
    """
    splits = tuple(splits) if splits is not None else manifest.splits
    shuffle = shuffle or {}
    readers: dict[str, Reader] = {}
    for split in splits:
        flag = shuffle.get(split, split == "train")
        kind = PreloadReader if cfg.data.reader == "preload" else DirectReader
        readers[split] = kind(cfg, manifest, split, comm, placement, shuffle=flag)
        LOG.debug("%s", describe_reader(readers[split], cfg.data.reader))
    note_compression(manifest, comm)
    preload = [r for r in readers.values() if isinstance(r, PreloadReader)]
    if preload:
        check_preload_memory(comm, sum(r.store_bytes for r in preload),
                             cfg.data.memory_fraction)
        for reader in preload:
            reader.prepare(check_memory=False)
    return readers
