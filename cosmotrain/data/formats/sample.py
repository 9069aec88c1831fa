"""What a CosmoFlow sample is, whatever file holds it: shapes, layouts, dtypes, checks.

A sample is 4 redshift channels of a ``W**3`` cube of particle counts plus 4 normalised
cosmological parameters (labels in ``[-1, 1]``).  On disk the volume is ``channels-last``
``[W, W, W, 4]`` (D, H, W, C: the original CosmoFlow, MLPerf and NVIDIA layout) or
``channels-first`` ``[4, W, W, W]`` (LBANN's split files), ``int16`` counts or ``float32``.
In memory the library always works in C, D, H, W order (PyTorch's).

This module is the vocabulary the file formats share (``hdf5_sample``, ``tfrecord_sample``,
``npy_sample``; ``formats`` picks one): :class:`VolumeInfo`, which every file of a dataset
must match, the layout conversions, the checks of shapes, labels and values, and the
hyperslab arithmetic.  Messages name the volume and the labels the way the format does
(``'full'`` and ``'unitPar'`` in HDF5, features ``'x'`` and ``'y'`` in TFRecord).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosmotrain.device.xp import all_finite
from cosmotrain.errors import DataError

NUM_CHANNELS = 4
NUM_LABELS = 4

CHANNELS_LAST = "channels-last"
CHANNELS_FIRST = "channels-first"
LAYOUTS: tuple[str, ...] = (CHANNELS_LAST, CHANNELS_FIRST)
DEFAULT_LAYOUT = CHANNELS_LAST

DTYPES: tuple[str, ...] = ("int16", "float32")
DEFAULT_DTYPE = "int16"
INT16_MAX = int(np.iinfo(np.int16).max)

HDF5, TFRECORD, NPY = "hdf5", "tfrecord", "npy"
FORMATS: tuple[str, ...] = (HDF5, TFRECORD, NPY)
# How each format names the volume and the labels, for messages.
VOLUME_NAMES = {HDF5: "'full'", TFRECORD: "feature 'x'", NPY: "the '_data.npy' array"}
LABEL_NAMES = {HDF5: "'unitPar'", TFRECORD: "feature 'y'", NPY: "'_label.npy'"}

Box = tuple[slice, slice, slice]
REPLACE_HINT = ("replace the file (a replaced file is read again at the next start), or remove "
                "it and its line in any list or manifest.json naming it")
LABEL_RANGE = (-1.0, 1.0)  # unitPar: normalised cosmological parameters
LABEL_HINT = (f"labels are the 4 normalised cosmological parameters, each in "
              f"[{LABEL_RANGE[0]:g}, {LABEL_RANGE[1]:g}]: fix or replace the file")


def check_layout(layout: str) -> None:
    """Raise ``ValueError`` for a layout name this module does not know."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def volume_shape(width: int, layout: str = DEFAULT_LAYOUT) -> tuple[int, int, int, int]:
    """Shape of the volume on disk for a ``width**3`` cube in ``layout``."""
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
    """Convert counts to the storage ``dtype``; int16 rounds and clips to [0, 32767] like MLPerf
    (int16 input is kept as it is)."""
    if dtype == "float32":
        return np.asarray(volume, dtype=np.float32)
    if dtype == "int16" and volume.dtype == np.int16:
        return volume  # already stored counts (a conversion between formats keeps them)
    if dtype == "int16":
        return np.clip(np.rint(volume), 0, INT16_MAX).astype(np.int16)
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")


def detect_layout(shape: tuple[int, ...], stored: object = None, name: str = "'full'") -> str:
    """The layout of a volume: the recorded attribute if any, else from its shape.

    A volume that is not 4-D is rejected whatever the attribute says.
    """
    if len(shape) != 4:
        raise ValueError(f"{name} has shape {tuple(shape)} ({len(shape)}-D), "
                         f"expected 4-D [W, W, W, 4] or [4, W, W, W]")
    if isinstance(stored, bytes):
        stored = stored.decode()
    if stored in LAYOUTS:
        return str(stored)
    if shape[-1] == NUM_CHANNELS:
        return CHANNELS_LAST
    if shape[0] == NUM_CHANNELS:
        return CHANNELS_FIRST
    raise ValueError(f"{name} has shape {shape}, expected [W, W, W, 4] or [4, W, W, W]")


@dataclass(frozen=True)
class SampleNames:
    """How a format names its sample files: by suffix (``.hdf5``, ``.tfrecord``, ...)."""

    suffixes: tuple[str, ...]

    def is_sample_name(self, name: str) -> bool:
        """A sample file of this format."""
        return name.endswith(self.suffixes)

    def sample_name(self, stem: str) -> str:
        """The file name of sample ``stem`` (the first suffix)."""
        return stem + self.suffixes[0]

    def sample_stem(self, name: str) -> str:
        """The sample's name without the format's suffix (``a.hdf5`` -> ``a``)."""
        return next((name[:-len(s)] for s in self.suffixes if name.endswith(s)), name)


@dataclass(frozen=True)
class VolumeInfo:
    """What a dataset's volumes look like on disk: every file must match it."""

    shape: tuple[int, ...]
    dtype: str
    layout: str
    format: str = HDF5

    @property
    def width(self) -> int:
        """Spatial extent of the (cubic) volume on disk."""
        return self.shape[0] if self.layout == CHANNELS_LAST else self.shape[1]

    @property
    def volume_name(self) -> str:
        """How messages name the volume in this format."""
        return VOLUME_NAMES[self.format]

    @property
    def label_name(self) -> str:
        """How messages name the labels in this format."""
        return LABEL_NAMES[self.format]


def volume_problem(shape: tuple[int, ...], layout: str, name: str = "'full'") -> str | None:
    """What is wrong with a volume shape in ``layout`` (None: a 4-channel cube)."""
    if len(shape) != 4:
        return (f"{name} has shape {tuple(shape)} ({len(shape)}-D), expected "
                f"4-D [W, W, W, 4] or [4, W, W, W]")
    spatial = shape[:3] if layout == CHANNELS_LAST else shape[1:]
    channels = shape[3] if layout == CHANNELS_LAST else shape[0]
    if channels != NUM_CHANNELS or len(set(spatial)) != 1 or min(spatial) < 1:
        return (f"{name} has shape {tuple(shape)}, expected a cube of "
                f"{NUM_CHANNELS} channels ({layout}: "
                f"{'[W, W, W, 4]' if layout == CHANNELS_LAST else '[4, W, W, W]'})")
    return None


def check_expected(path: Path, info: VolumeInfo, expect: VolumeInfo) -> None:
    """A file must match its dataset (shape, layout, dtype): a dataset mixing them would
    break the readers later, far from the culprit."""
    name = info.volume_name
    if info.shape != expect.shape or info.layout != expect.layout:
        raise DataError(path, f"{name} has shape {info.shape} ({info.layout}) but "
                        f"the dataset's files have {expect.shape} ({expect.layout})",
                        REPLACE_HINT)
    if info.dtype != expect.dtype:
        raise DataError(path, f"{name} is {info.dtype} but the dataset's files "
                        f"are {expect.dtype}", REPLACE_HINT)


def label_problem(values: np.ndarray, name: str = "'unitPar'") -> str | None:
    """What is wrong with one file's present labels (None: finite and in range)."""
    shown = "[" + ", ".join(f"{v:g}" for v in np.asarray(values).ravel()) + "]"
    if not np.isfinite(values).all():
        return f"{name} holds a non-finite label (NaN or Inf): {shown}"
    low, high = LABEL_RANGE
    if (values < low).any() or (values > high).any():
        return f"{name} holds a label outside [{low:g}, {high:g}]: {shown}"
    return None


def checked_labels(path: Path, values: np.ndarray | None, name: str = "'unitPar'"
                   ) -> np.ndarray:
    """float32 ``(4,)``: the labels, or NaN for a file without them (unlabelled data).

    Labels that are there must be 4, finite and in :data:`LABEL_RANGE` (a NaN label would
    otherwise read as a missing one, and an out-of-range one would train silently).
    """
    if values is None:
        return np.full(NUM_LABELS, np.nan, dtype=np.float32)
    values = np.asarray(values, dtype=np.float32)
    if values.shape != (NUM_LABELS,):
        raise DataError(path, f"{name} has shape {values.shape}, expected (4,)", LABEL_HINT)
    problem = label_problem(values, name)
    if problem is not None:
        raise DataError(path, problem, LABEL_HINT)
    return values


def check_finite(path: Path, block: np.ndarray, name: str = "'full'") -> None:
    """Reject a float block holding NaN or Inf, naming the file (int16 cannot hold them);
    the same one-pass test as the trainer's gradient check (``device.xp.all_finite``)."""
    if block.dtype.kind != "f" or all_finite([block]):
        return
    bad = int(np.count_nonzero(~np.isfinite(block)))
    raise DataError(path, f"{name} holds {bad} non-finite value(s) (NaN or "
                    f"Inf) in the block read", "fix or replace the file: training must "
                    "not see NaN or Inf inputs")


def region(path: Path, box: Box | None, origin: tuple[int, int, int],
           extent: tuple[int, ...]) -> Box:
    """``box`` (None: the whole volume) shifted by ``origin``, checked against the volume's
    spatial ``extent``."""
    box = box or tuple(slice(0, n) for n in extent)  # type: ignore[assignment]
    shifted = tuple(slice(s.start + o, s.stop + o) for s, o in zip(box, origin))
    for dim, (s, n) in enumerate(zip(shifted, extent)):
        if not 0 <= s.start <= s.stop <= n:
            raise DataError(path, f"planes [{s.start}, {s.stop}) of dimension {'DHW'[dim]} "
                            f"are outside the volume of {tuple(extent)}",
                            "check model.width against the files (cosmotrain info)")
    return shifted  # type: ignore[return-value]


def spatial_extent(info: VolumeInfo) -> tuple[int, int, int]:
    """D, H, W of the volume on disk."""
    shape = info.shape[:3] if info.layout == CHANNELS_LAST else info.shape[1:]
    return tuple(int(n) for n in shape)  # type: ignore[return-value]


def copy_block(path: Path, volume: np.ndarray, info: VolumeInfo, box: Box | None,
               origin: tuple[int, int, int], channels: slice,
               out: np.ndarray | None = None) -> np.ndarray:
    """The block (``channels`` x ``box`` at ``origin``) of an array-like ``volume`` in the
    file's layout (a memory map, an HDF5 dataset), in C, D, H, W order and the stored dtype,
    into ``out`` when given: only the block's bytes are read."""
    where = region(path, box, origin, spatial_extent(info))
    shape = (channels.stop - channels.start,) + tuple(s.stop - s.start for s in where)
    if out is None:
        out = np.empty(shape, dtype=info.dtype)
    if 0 in shape:
        return out
    if info.layout == CHANNELS_LAST:
        np.copyto(out, from_layout(volume[where + (channels,)], info.layout))
    else:
        np.copyto(out, volume[(channels,) + where])
    return out
