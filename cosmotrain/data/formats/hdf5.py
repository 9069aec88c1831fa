"""The CosmoFlow HDF5 sample: one file per sample (or per universe), two datasets.

- ``full``: the particle-count volume (``volume.py``: channels-last ``[W, W, W, 4]`` or
  channels-first ``[4, W, W, W]``; int16 or float32), contiguous and uncompressed so a
  rank reads only its hyperslab;
- ``unitPar``: the 4 normalised cosmological parameters, float32 in ``[-1, 1]``.  A file
  without it (data to predict on) reads as NaN labels.

Files written here record their layout in the ``layout`` attribute of the root group, so a
reader never has to guess; files from elsewhere are recognised by their shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from cosmotrain.files.atomic import write_hdf5_atomically
from cosmotrain.data.formats.read_errors import HDF5_ERRORS, named_on_failure
from cosmotrain.data.formats.sample import (CHANNELS_LAST, DEFAULT_DTYPE, DEFAULT_LAYOUT, DTYPES,
                                             NUM_CHANNELS, NUM_LABELS, Box, SampleNames,
                                             VolumeInfo, check_expected, check_finite,
                                             check_layout, checked_labels, copy_block,
                                             detect_layout, encode_counts, region, spatial_extent,
                                             to_layout, volume_problem)
from cosmotrain.errors import DataError

VOLUME_DATASET = "full"
LABELS_DATASET = "unitPar"
LAYOUT_ATTR = "layout"
SUFFIXES = (".hdf5", ".h5")
FORMAT_HINT = (f"expected datasets '{VOLUME_DATASET}' ([W, W, W, 4] or [4, W, W, W], "
               f"{' or '.join(DTYPES)}) and '{LABELS_DATASET}' (4 float32)")


NAMES = SampleNames(SUFFIXES)
is_sample_name, sample_name, sample_stem = (NAMES.is_sample_name, NAMES.sample_name,
                                            NAMES.sample_stem)


def write_sample(path: Path, volume_cdhw: np.ndarray, labels: np.ndarray, *,
                 layout: str = DEFAULT_LAYOUT, dtype: str = DEFAULT_DTYPE,
                 attrs: Mapping[str, object] | None = None, where: str = "--out") -> Path:
    """Write one sample file atomically: ``<name>.tmp`` in the same directory, then rename.

    A reader (or a restarted generator) therefore never sees a half-written sample.  The
    volume is stored contiguously and uncompressed so later readers can take spatial
    hyperslabs cheaply.  ``attrs`` are extra root attributes (provenance).  Labels of NaN
    (unlabelled data) are left out.  A write the disk refuses raises
    :class:`~cosmotrain.errors.WriteError` naming ``path`` (``where``: the option that
    chose it) and leaves no ``.tmp``.

    The file is built in memory and written with plain file I/O, like a checkpoint
    (:func:`cosmotrain.files.atomic.write_hdf5_atomically`): h5py writing a small sample onto a
    nearly full disk segfaults in its flush.  It costs the file's size in host memory
    while it is written (1 GiB for a 512^3 int16 sample).
    """
    data = encode_counts(to_layout(volume_cdhw, layout), dtype)
    labels = np.asarray(labels, dtype=np.float32)

    def fill(handle: h5py.File) -> None:
        handle.create_dataset(VOLUME_DATASET, data=data)
        if not np.isnan(labels).all():
            handle.create_dataset(LABELS_DATASET, data=labels)
        handle.attrs[LAYOUT_ATTR] = layout
        for key, value in (attrs or {}).items():
            handle.attrs[key] = value
    return write_hdf5_atomically(Path(path), fill, where)


def probe(path: Path, expect: VolumeInfo | None = None) -> tuple[VolumeInfo, np.ndarray]:
    """Header and labels of one sample file, without reading the volume.

    With ``expect`` the file must match it (shape and dtype).  Every problem raises
    :class:`DataError` naming the file.
    """
    with named_on_failure(path, HDF5_ERRORS, FORMAT_HINT), h5py.File(path, "r") as handle:
        volume, labels = _datasets(path, handle)
        info = _volume_info(path, handle, volume)
        label_values = checked_labels(
            path, None if labels is None else labels[()], f"'{LABELS_DATASET}'")
    if expect is not None:
        check_expected(path, info, expect)
    return info, label_values


def read_sample(path: Path, layout: str | None = None, box: Box | None = None,
                origin: tuple[int, int, int] = (0, 0, 0)) -> tuple[np.ndarray, np.ndarray]:
    """Read one sample, or one block of it: ``(volume, labels)``, float32 C, D, H, W and ``(4,)``.

    ``layout`` overrides the recorded or shape-inferred layout (see ``formats.read_sample``).
    """
    with named_on_failure(path, HDF5_ERRORS, FORMAT_HINT), h5py.File(path, "r") as handle:
        volume, labels = _datasets(path, handle)
        info = _volume_info(path, handle, volume, layout)
        block = _hyperslab(path, volume, info, box, origin, slice(0, NUM_CHANNELS))
        label_values = checked_labels(
            path, None if labels is None else labels[()], f"'{LABELS_DATASET}'")
    check_finite(path, block)
    return np.ascontiguousarray(block, dtype=np.float32), label_values


def read_block(path: Path, expect: VolumeInfo, box: Box | None = None,
               origin: tuple[int, int, int] = (0, 0, 0),
               channels: slice = slice(0, NUM_CHANNELS),
               out: np.ndarray | None = None) -> np.ndarray:
    """One hyperslab in the stored dtype, C, D, H, W (see ``formats.read_block``).

    ``out`` receives the block without an extra copy for channels-first files and with
    one transposing copy for channels-last ones.
    """
    with named_on_failure(path, HDF5_ERRORS, FORMAT_HINT), h5py.File(path, "r") as handle:
        volume = _datasets(path, handle)[0]
        check_expected(path, _volume_info(path, handle, volume), expect)
        block = _hyperslab(path, volume, expect, box, origin, channels, out)
    check_finite(path, block)
    return np.ascontiguousarray(block)


def _volume_info(path: Path, handle: h5py.File, volume: h5py.Dataset,
                 layout: str | None = None) -> VolumeInfo:
    layout = layout or detect_layout(volume.shape, handle.attrs.get(LAYOUT_ATTR))
    check_layout(layout)
    shape = tuple(int(n) for n in volume.shape)
    problem = volume_problem(shape, layout)
    if problem is not None:
        raise DataError(path, problem, FORMAT_HINT)
    return VolumeInfo(shape, volume.dtype.name, layout)


def _datasets(path: Path, handle: h5py.File) -> tuple[h5py.Dataset, h5py.Dataset | None]:
    """The volume and the labels (None when the file has none: unlabelled data)."""
    if VOLUME_DATASET not in handle:
        raise DataError(path, f"no dataset '{VOLUME_DATASET}'", FORMAT_HINT)
    volume = handle[VOLUME_DATASET]
    labels = handle[LABELS_DATASET] if LABELS_DATASET in handle else None
    for name, found in ((VOLUME_DATASET, volume), (LABELS_DATASET, labels)):
        if found is not None and not isinstance(found, h5py.Dataset):
            raise DataError(path, f"'{name}' is a {type(found).__name__}, not a dataset",
                            FORMAT_HINT)
    if volume.dtype.name not in DTYPES:
        raise DataError(path, f"'{VOLUME_DATASET}' is {volume.dtype.name}", FORMAT_HINT)
    if labels is not None and labels.shape != (NUM_LABELS,):
        raise DataError(path, f"'{LABELS_DATASET}' has shape {labels.shape}, expected (4,)")
    return volume, labels


def _hyperslab(path: Path, volume: h5py.Dataset, info: VolumeInfo, box: Box | None,
               origin: tuple[int, int, int], channels: slice,
               out: np.ndarray | None = None) -> np.ndarray:
    """The block in C, D, H, W order and the stored dtype (one read, in the file's layout);
    channels-first reads straight into ``out`` (h5py's ``read_direct``)."""
    if info.layout == CHANNELS_LAST:
        return copy_block(path, volume, info, box, origin, channels, out)
    where = region(path, box, origin, spatial_extent(info))
    shape = (channels.stop - channels.start,) + tuple(s.stop - s.start for s in where)
    if out is None:
        out = np.empty(shape, dtype=volume.dtype)
    if 0 not in shape:
        volume.read_direct(out, source_sel=(channels,) + where)
    return out
