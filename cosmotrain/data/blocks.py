"""Spatial reads: one rank's block of a sample, straight from its HDF5 file.

A rank that holds block ``[d0:d1, h0:h1, w0:w1]`` of every sample of its batch reads only
those bytes: an h5py hyperslab selection in the file's own layout, so the ranks of one
sample group never read the same voxel twice and nobody reads a whole 512^3 universe.
``origin`` places a model-width sub-cube inside a larger volume (whole universes cut into
sub-cubes on the fly).  Every problem with a file (unreadable, truncated, missing dataset,
wrong shape or dtype, a block outside the volume) raises :class:`DataError` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

from cosmotrain.data.formats import (CHANNELS_LAST, DTYPES, LABELS_DATASET, LAYOUT_ATTR,
                                     NUM_CHANNELS, NUM_LABELS, VOLUME_DATASET, detect_layout)
from cosmotrain.errors import DataError

Box = tuple[slice, slice, slice]
FORMAT_HINT = (f"expected datasets '{VOLUME_DATASET}' ([W, W, W, 4] or [4, W, W, W], "
               f"{' or '.join(DTYPES)}) and '{LABELS_DATASET}' (4 float32)")


def read_block(path: Path, box: Box, origin: Sequence[int] = (0, 0, 0),
               layout: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(block, labels)``: float32 ``(4, d, h, w)`` of ``box`` (+ ``origin``), labels ``(4,)``."""
    try:
        with h5py.File(path, "r") as handle:
            volume, labels = _datasets(path, handle)
            layout = layout or detect_layout(volume.shape, handle.attrs.get(LAYOUT_ATTR))
            region = _region(path, box, origin, _spatial_shape(volume.shape, layout))
            block = _read(volume, region, layout)
            label_values = labels[()]
    except (OSError, ValueError, KeyError) as err:
        raise DataError(path, str(err), FORMAT_HINT) from err
    return block, np.asarray(label_values, dtype=np.float32)


def _datasets(path: Path, handle: h5py.File) -> tuple[h5py.Dataset, h5py.Dataset]:
    for name in (VOLUME_DATASET, LABELS_DATASET):
        if name not in handle:
            raise DataError(path, f"no dataset '{name}'", FORMAT_HINT)
    volume, labels = handle[VOLUME_DATASET], handle[LABELS_DATASET]
    if volume.dtype.name not in DTYPES:
        raise DataError(path, f"'{VOLUME_DATASET}' is {volume.dtype.name}", FORMAT_HINT)
    if labels.shape != (NUM_LABELS,):
        raise DataError(path, f"'{LABELS_DATASET}' has shape {labels.shape}, expected (4,)")
    return volume, labels


def _spatial_shape(shape: tuple[int, ...], layout: str) -> tuple[int, int, int]:
    return tuple(shape[:3] if layout == CHANNELS_LAST else shape[1:])  # type: ignore[return-value]


def _region(path: Path, box: Box, origin: Sequence[int], extent: tuple[int, int, int]
            ) -> Box:
    """``box`` shifted by ``origin``, checked against the volume's spatial ``extent``."""
    region = tuple(slice(s.start + o, s.stop + o) for s, o in zip(box, origin))
    for dim, (s, n) in enumerate(zip(region, extent)):
        if not 0 <= s.start <= s.stop <= n:
            raise DataError(path, f"planes [{s.start}, {s.stop}) of dimension {'DHW'[dim]} "
                            f"are outside the volume of {extent}",
                            "check model.width against the files (cosmotrain info)")
    return region  # type: ignore[return-value]


def _read(volume: h5py.Dataset, region: Box, layout: str) -> np.ndarray:
    """The hyperslab in C, D, H, W order, float32 (one read, in the file's layout)."""
    if layout == CHANNELS_LAST:
        raw = volume[region + (slice(0, NUM_CHANNELS),)]
        return np.ascontiguousarray(np.moveaxis(raw, -1, 0), dtype=np.float32)
    return np.ascontiguousarray(volume[(slice(0, NUM_CHANNELS),) + region], dtype=np.float32)
