"""The CosmoFlow HDF5 sample format: names, layouts, dtypes, and one-sample write and read.

One sample is one HDF5 file with two datasets:

- ``full``: the particle-count volume, 4 redshift channels of a ``W**3`` cube, either
  ``channels-last`` ``[W, W, W, 4]`` (D, H, W, C; the original CosmoFlow and MLPerf layout, the
  default) or ``channels-first`` ``[4, W, W, W]`` (C, D, H, W; LBANN's split files), stored as
  ``int16`` (counts clipped to 32767, the default) or ``float32``;
- ``unitPar``: the 4 normalised cosmological parameters, float32 in ``[-1, 1]``.  Training
  needs it; a file without it (data to predict on) reads as NaN labels.  Labels that are
  there must be finite and in ``[-1, 1]``; float32 volumes must be finite.

Files written here record their layout in the ``layout`` attribute of the root group, so a
reader never has to guess; files from elsewhere are recognised by their shape.  In memory the
library always works in C, D, H, W order (PyTorch's), whatever the file layout.

``read_sample`` returns a sample (or a block of it) as float32; the readers use
``read_block`` (one hyperslab in the stored dtype, checked against the dataset's
``VolumeInfo``) and ``probe`` (header and labels only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from cosmotrain.atomic import write_hdf5_atomically
from cosmotrain.device.xp import all_finite
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
    where: str = "--out",
) -> Path:
    """Write one sample file atomically: ``<name>.tmp`` in the same directory, then rename.

    A reader (or a restarted generator) therefore never sees a half-written sample.  The
    volume is stored contiguously and uncompressed so later readers can take spatial
    hyperslabs cheaply.  ``attrs`` are extra root attributes (provenance).  A write the
    disk refuses raises :class:`~cosmotrain.errors.WriteError` naming ``path`` (``where``:
    the option that chose it) and leaves no ``.tmp``.

    The file is built in memory and written with plain file I/O, like a checkpoint
    (:func:`cosmotrain.atomic.write_hdf5_atomically`): h5py writing a small sample onto a
    nearly full disk segfaults in its flush.  It costs the file's size in host memory
    while it is written (1 GiB for a 512^3 int16 sample).
    """
    data = encode_counts(to_layout(volume_cdhw, layout), dtype)

    def fill(handle: h5py.File) -> None:
        handle.create_dataset(VOLUME_DATASET, data=data)
        handle.create_dataset(LABELS_DATASET, data=np.asarray(labels, dtype=np.float32))
        handle.attrs[LAYOUT_ATTR] = layout
        for key, value in (attrs or {}).items():
            handle.attrs[key] = value
    return write_hdf5_atomically(Path(path), fill, where)


def detect_layout(shape: tuple[int, ...], stored: object = None) -> str:
    """The layout of a ``full`` dataset: the recorded attribute if any, else from its shape.

    A volume that is not 4-D is rejected whatever the attribute says.
    """
    if len(shape) != 4:
        raise ValueError(f"'{VOLUME_DATASET}' has shape {tuple(shape)} ({len(shape)}-D), "
                         f"expected 4-D [W, W, W, 4] or [4, W, W, W]")
    if isinstance(stored, bytes):
        stored = stored.decode()
    if stored in LAYOUTS:
        return str(stored)
    if len(shape) == 4 and shape[-1] == NUM_CHANNELS:
        return CHANNELS_LAST
    if len(shape) == 4 and shape[0] == NUM_CHANNELS:
        return CHANNELS_FIRST
    raise ValueError(f"'{VOLUME_DATASET}' has shape {shape}, expected [W, W, W, 4] or [4, W, W, W]")


Box = tuple[slice, slice, slice]
FORMAT_HINT = (f"expected datasets '{VOLUME_DATASET}' ([W, W, W, 4] or [4, W, W, W], "
               f"{' or '.join(DTYPES)}) and '{LABELS_DATASET}' (4 float32)")
REPLACE_HINT = "replace or remove the file, then rebuild the manifest (delete its cache)"
LABEL_RANGE = (-1.0, 1.0)  # unitPar: normalised cosmological parameters
LABEL_HINT = (f"labels are the 4 normalised cosmological parameters, each in "
              f"[{LABEL_RANGE[0]:g}, {LABEL_RANGE[1]:g}]: fix or replace the file")


@dataclass(frozen=True)
class VolumeInfo:
    """What a dataset's ``full`` arrays look like on disk: every file must match it."""

    shape: tuple[int, ...]
    dtype: str
    layout: str

    @property
    def width(self) -> int:
        """Spatial extent of the (cubic) volume on disk."""
        return self.shape[0] if self.layout == CHANNELS_LAST else self.shape[1]


def probe(path: Path, expect: VolumeInfo | None = None) -> tuple[VolumeInfo, np.ndarray]:
    """Header and labels of one sample file, without reading the volume.

    With ``expect`` the file must match it (shape and dtype): a dataset mixing shapes or
    dtypes would break the readers later, far from the culprit.  Every problem raises
    :class:`DataError` naming the file.
    """
    try:
        with h5py.File(path, "r") as handle:
            volume, labels = _datasets(path, handle)
            info = _volume_info(path, handle, volume)
            label_values = _label_values(path, labels)
    except (OSError, ValueError, KeyError) as err:
        raise DataError(path, str(err), FORMAT_HINT) from err
    if expect is not None:
        _check_expected(path, info, expect)
    return info, label_values


def read_sample(path: Path, layout: str | None = None, box: Box | None = None,
                origin: tuple[int, int, int] = (0, 0, 0)) -> tuple[np.ndarray, np.ndarray]:
    """Read one sample, or one block of it: ``(volume, labels)``, float32 C, D, H, W and ``(4,)``.

    ``box`` (D, H, W slices; None = the whole volume) shifted by ``origin`` selects a
    hyperslab, read in the file's own layout: a rank reads only its spatial block, and a
    model-width cube is cut out of a larger universe on the fly.  ``layout`` overrides the
    recorded or shape-inferred layout.  Every problem (unreadable or truncated file,
    missing dataset, wrong shape or dtype, a block outside the volume) raises
    :class:`DataError` naming the file.
    """
    try:
        with h5py.File(path, "r") as handle:
            volume, labels = _datasets(path, handle)
            layout = layout or _volume_info(path, handle, volume).layout
            check_layout(layout)
            _check_cube(path, tuple(volume.shape), layout)
            block = _hyperslab(path, volume, layout, box, origin, slice(0, NUM_CHANNELS))
            label_values = _label_values(path, labels)
    except (OSError, ValueError, KeyError) as err:
        raise DataError(path, str(err), FORMAT_HINT) from err
    check_finite(path, block)
    return np.ascontiguousarray(block, dtype=np.float32), label_values


def read_block(path: Path, expect: VolumeInfo, box: Box | None = None,
               origin: tuple[int, int, int] = (0, 0, 0),
               channels: slice = slice(0, NUM_CHANNELS),
               out: np.ndarray | None = None) -> np.ndarray:
    """One hyperslab (``channels`` x ``box`` at ``origin``) in the stored dtype, C, D, H, W.

    The readers' path: the dtype is kept (an int16 block is half the bytes of float32 in
    the preload store and in flight), the labels are not read (the manifest has them),
    and the file must match the dataset's ``expect``-ed shape, dtype and layout.  ``out``
    (C-contiguous, the block's shape and dtype) receives the block without an extra copy
    for channels-first files and with one transposing copy for channels-last ones.
    """
    try:
        with h5py.File(path, "r") as handle:
            volume = _datasets(path, handle)[0]
            _check_expected(path, _volume_info(path, handle, volume), expect)
            block = _hyperslab(path, volume, expect.layout, box, origin, channels, out)
    except (OSError, ValueError, KeyError) as err:
        raise DataError(path, str(err), FORMAT_HINT) from err
    check_finite(path, block)
    return np.ascontiguousarray(block)


def check_finite(path: Path, block: np.ndarray) -> None:
    """Reject a float block holding NaN or Inf, naming the file (int16 cannot hold them);
    the same one-pass test as the trainer's gradient check (``device.xp.all_finite``)."""
    if block.dtype.kind != "f" or all_finite([block]):
        return
    bad = int(np.count_nonzero(~np.isfinite(block)))
    raise DataError(path, f"'{VOLUME_DATASET}' holds {bad} non-finite value(s) (NaN or "
                    f"Inf) in the block read", "fix or replace the file: training must "
                    "not see NaN or Inf inputs")


def _volume_info(path: Path, handle: h5py.File, volume: h5py.Dataset) -> VolumeInfo:
    layout = detect_layout(volume.shape, handle.attrs.get(LAYOUT_ATTR))
    shape = tuple(int(n) for n in volume.shape)
    _check_cube(path, shape, layout)
    return VolumeInfo(shape, volume.dtype.name, layout)


def volume_problem(shape: tuple[int, ...], layout: str) -> str | None:
    """What is wrong with a ``full`` shape in ``layout`` (None: a 4-channel cube)."""
    if len(shape) != 4:
        return (f"'{VOLUME_DATASET}' has shape {tuple(shape)} ({len(shape)}-D), expected "
                f"4-D [W, W, W, 4] or [4, W, W, W]")
    spatial = shape[:3] if layout == CHANNELS_LAST else shape[1:]
    channels = shape[3] if layout == CHANNELS_LAST else shape[0]
    if channels != NUM_CHANNELS or len(set(spatial)) != 1 or min(spatial) < 1:
        return (f"'{VOLUME_DATASET}' has shape {tuple(shape)}, expected a cube of "
                f"{NUM_CHANNELS} channels ({layout}: "
                f"{'[W, W, W, 4]' if layout == CHANNELS_LAST else '[4, W, W, W]'})")
    return None


def _check_cube(path: Path, shape: tuple[int, ...], layout: str) -> None:
    problem = volume_problem(shape, layout)
    if problem is not None:
        raise DataError(path, problem, FORMAT_HINT)


def _check_expected(path: Path, info: VolumeInfo, expect: VolumeInfo) -> None:
    if info.shape != expect.shape or info.layout != expect.layout:
        raise DataError(path, f"'{VOLUME_DATASET}' has shape {info.shape} ({info.layout}) but "
                        f"the dataset's files have {expect.shape} ({expect.layout})",
                        REPLACE_HINT)
    if info.dtype != expect.dtype:
        raise DataError(path, f"'{VOLUME_DATASET}' is {info.dtype} but the dataset's files "
                        f"are {expect.dtype}", REPLACE_HINT)


def _datasets(path: Path, handle: h5py.File) -> tuple[h5py.Dataset, h5py.Dataset | None]:
    """The volume and the labels (None when the file has none: unlabelled data)."""
    if VOLUME_DATASET not in handle:
        raise DataError(path, f"no dataset '{VOLUME_DATASET}'", FORMAT_HINT)
    volume = handle[VOLUME_DATASET]
    labels = handle[LABELS_DATASET] if LABELS_DATASET in handle else None
    if volume.dtype.name not in DTYPES:
        raise DataError(path, f"'{VOLUME_DATASET}' is {volume.dtype.name}", FORMAT_HINT)
    if labels is not None and labels.shape != (NUM_LABELS,):
        raise DataError(path, f"'{LABELS_DATASET}' has shape {labels.shape}, expected (4,)")
    return volume, labels


def _label_values(path: Path, labels: h5py.Dataset | None) -> np.ndarray:
    """float32 ``(4,)``: the labels, or NaN for a file without them.

    Labels that are there must be finite and in :data:`LABEL_RANGE` (a NaN label would
    otherwise read as a missing one, and an out-of-range one would train silently).
    """
    if labels is None:
        return np.full(NUM_LABELS, np.nan, dtype=np.float32)
    values = np.asarray(labels[()], dtype=np.float32)
    problem = label_problem(values)
    if problem is not None:
        raise DataError(path, problem, LABEL_HINT)
    return values


def label_problem(values: np.ndarray) -> str | None:
    """What is wrong with one file's present labels (None: finite and in range)."""
    shown = "[" + ", ".join(f"{v:g}" for v in np.asarray(values).ravel()) + "]"
    if not np.isfinite(values).all():
        return f"'{LABELS_DATASET}' holds a non-finite label (NaN or Inf): {shown}"
    low, high = LABEL_RANGE
    if (values < low).any() or (values > high).any():
        return f"'{LABELS_DATASET}' holds a label outside [{low:g}, {high:g}]: {shown}"
    return None


def _region(path: Path, box: Box, origin: tuple[int, int, int],
            extent: tuple[int, ...]) -> Box:
    """``box`` shifted by ``origin``, checked against the volume's spatial ``extent``."""
    region = tuple(slice(s.start + o, s.stop + o) for s, o in zip(box, origin))
    for dim, (s, n) in enumerate(zip(region, extent)):
        if not 0 <= s.start <= s.stop <= n:
            raise DataError(path, f"planes [{s.start}, {s.stop}) of dimension {'DHW'[dim]} "
                            f"are outside the volume of {tuple(extent)}",
                            "check model.width against the files (cosmotrain info)")
    return region  # type: ignore[return-value]


def _hyperslab(path: Path, volume: h5py.Dataset, layout: str, box: Box | None,
               origin: tuple[int, int, int], channels: slice,
               out: np.ndarray | None = None) -> np.ndarray:
    """The block in C, D, H, W order and the stored dtype (one read, in the file's layout),
    into ``out`` when given."""
    extent = volume.shape[:3] if layout == CHANNELS_LAST else volume.shape[1:]
    region = _region(path, box or tuple(slice(0, n) for n in extent), origin, extent)
    shape = (channels.stop - channels.start,) + tuple(s.stop - s.start for s in region)
    if out is None:
        out = np.empty(shape, dtype=volume.dtype)
    if 0 in shape:
        return out
    if layout == CHANNELS_LAST:
        np.copyto(out, from_layout(volume[region + (channels,)], layout))
    else:
        volume.read_direct(out, source_sel=(channels,) + region)
    return out
