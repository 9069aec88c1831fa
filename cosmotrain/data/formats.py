"""The CosmoFlow HDF5 sample format: names, layouts, dtypes, and one-sample write and read.

One sample is one HDF5 file with two datasets:

- ``full``: the particle-count volume, 4 redshift channels of a ``W**3`` cube, either
  ``channels-last`` ``[W, W, W, 4]`` (D, H, W, C; the original CosmoFlow and MLPerf layout, the
  default) or ``channels-first`` ``[4, W, W, W]`` (C, D, H, W; LBANN's split files), stored as
  ``int16`` (counts clipped to 32767, the default) or ``float32``;
- ``unitPar``: the 4 normalised cosmological parameters, float32 in ``[-1, 1]``.

Files written here record their layout in the ``layout`` attribute of the root group, so a
reader never has to guess; files from elsewhere are recognised by their shape.  In memory the
library always works in C, D, H, W order (PyTorch's), whatever the file layout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import h5py
import numpy as np

from cosmotrain.errors import DataError

VOLUME_DATASET = "full"
LABELS_DATASET = "unitPar"
LAYOUT_ATTR = "layout"
NUM_CHANNELS = 4
NUM_LABELS = 4

CHANNELS_LAST = "channels-last"
CHANNELS_FIRST = "channels-first"
LAYOUTS: tuple[str, ...] = (CHANNELS_LAST, CHANNELS_FIRST)
DEFAULT_LAYOUT = CHANNELS_LAST

DTYPES: tuple[str, ...] = ("int16", "float32")
DEFAULT_DTYPE = "int16"
INT16_MAX = int(np.iinfo(np.int16).max)


def check_layout(layout: str) -> None:
    """Raise ``ValueError`` for a layout name this module does not know."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def volume_shape(width: int, layout: str = DEFAULT_LAYOUT) -> tuple[int, int, int, int]:
    """Shape of ``full`` on disk for a ``width**3`` cube in ``layout``."""
    check_layout(layout)
    if layout == CHANNELS_LAST:
        return (width, width, width, NUM_CHANNELS)
    return (NUM_CHANNELS, width, width, width)


def to_layout(volume_cdhw: np.ndarray, layout: str) -> np.ndarray:
    """Reorder an in-memory C, D, H, W volume into the on-disk ``layout`` (a view, no copy)."""
    check_layout(layout)
    return np.moveaxis(volume_cdhw, 0, -1) if layout == CHANNELS_LAST else volume_cdhw


def from_layout(volume: np.ndarray, layout: str) -> np.ndarray:
    """Reorder an on-disk ``layout`` volume into C, D, H, W (a view, no copy)."""
    check_layout(layout)
    return np.moveaxis(volume, -1, 0) if layout == CHANNELS_LAST else volume


def encode_counts(volume: np.ndarray, dtype: str) -> np.ndarray:
    """Convert counts to the storage ``dtype``; int16 rounds and clips to [0, 32767] like MLPerf."""
    if dtype == "float32":
        return np.asarray(volume, dtype=np.float32)
    if dtype == "int16":
        return np.clip(np.rint(volume), 0, INT16_MAX).astype(np.int16)
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")


def write_sample(
    path: Path,
    volume_cdhw: np.ndarray,
    labels: np.ndarray,
    *,
    layout: str = DEFAULT_LAYOUT,
    dtype: str = DEFAULT_DTYPE,
    attrs: Mapping[str, object] | None = None,
) -> None:
    """Write one sample file atomically: ``<name>.tmp`` in the same directory, then rename.

    A reader (or a restarted generator) therefore never sees a half-written sample.  The
    volume is stored contiguously and uncompressed so later readers can take spatial
    hyperslabs cheaply.  ``attrs`` are extra root attributes (provenance).
    """
    path = Path(path)
    data = encode_counts(to_layout(volume_cdhw, layout), dtype)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with h5py.File(tmp, "w") as handle:
            handle.create_dataset(VOLUME_DATASET, data=data)
            handle.create_dataset(LABELS_DATASET, data=np.asarray(labels, dtype=np.float32))
            handle.attrs[LAYOUT_ATTR] = layout
            for key, value in (attrs or {}).items():
                handle.attrs[key] = value
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def detect_layout(shape: tuple[int, ...], stored: object = None) -> str:
    """The layout of a ``full`` dataset: the recorded attribute if any, else from its shape."""
    if isinstance(stored, bytes):
        stored = stored.decode()
    if stored in LAYOUTS:
        return str(stored)
    if len(shape) == 4 and shape[-1] == NUM_CHANNELS:
        return CHANNELS_LAST
    if len(shape) == 4 and shape[0] == NUM_CHANNELS:
        return CHANNELS_FIRST
    raise ValueError(f"'{VOLUME_DATASET}' has shape {shape}, expected [W, W, W, 4] or [4, W, W, W]")


def read_sample(path: Path, layout: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read one sample: ``(volume, labels)`` as float32 C, D, H, W and float32 ``(4,)``.

    ``layout`` overrides the recorded or shape-inferred layout.  An unreadable file, a missing
    dataset or a bad shape raises :class:`DataError` naming the file.
    """
    fix = f"expected an HDF5 file with datasets '{VOLUME_DATASET}' and '{LABELS_DATASET}'"
    try:
        with h5py.File(path, "r") as handle:
            missing = [name for name in (VOLUME_DATASET, LABELS_DATASET) if name not in handle]
            if missing:
                raise DataError(path, f"no dataset '{missing[0]}'", fix)
            volume_ds, labels = handle[VOLUME_DATASET], handle[LABELS_DATASET][()]
            layout = layout or detect_layout(volume_ds.shape, handle.attrs.get(LAYOUT_ATTR))
            volume = from_layout(volume_ds[()], layout)
    except (OSError, ValueError) as err:
        raise DataError(path, str(err), fix) from err
    if np.shape(labels) != (NUM_LABELS,):
        raise DataError(path, f"'{LABELS_DATASET}' has shape {np.shape(labels)}, expected (4,)")
    return np.ascontiguousarray(volume, dtype=np.float32), np.asarray(labels, dtype=np.float32)
