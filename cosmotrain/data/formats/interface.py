"""The sample file formats, behind one interface: HDF5, MLPerf TFRecord, NVIDIA numpy.

=========  ==============================================  ==============================
format     one sample                                     module
=========  ==============================================  ==============================
hdf5       ``*.hdf5`` / ``*.h5``: datasets ``full``,       :mod:`.hdf5_sample`
           ``unitPar`` (any layout, int16 or float32)
tfrecord   ``*.tfrecord``: one ``Example`` record          :mod:`.tfrecord_sample`
           (``x``: int16 [W, W, W, 4] bytes, ``y``: 4
           floats), plain or whole-file gzip (MLPerf);
           ``<file>#<k>``: record k of a file of several
npy        ``<name>_data.npy`` + ``<name>_label.npy``      :mod:`.npy_sample`
           (NVIDIA's MLPerf layout)
=========  ==============================================  ==============================

Every format offers the same four operations, and the readers, the manifest, staging and
``convert`` use them only through this module: ``probe`` (header and labels, checked
against the dataset's :class:`VolumeInfo`), ``read_block`` (one hyperslab in the stored
dtype, C, D, H, W: a rank reads only its block; uncompressed TFRecord and .npy are
memory-mapped at the payload), ``read_sample`` (float32, for tools and tests) and
``write_sample``.  The dataset's format travels in ``VolumeInfo.format``.  The shared
vocabulary (:mod:`.volume`) is re-exported here for the callers that know this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import numpy as np

from cosmotrain.data.formats import (hdf5 as hdf5_sample, npy as npy_sample,
                                      tfrecord as tfrecord_sample)
from cosmotrain.data.formats.hdf5 import FORMAT_HINT, LABELS_DATASET, LAYOUT_ATTR, VOLUME_DATASET
from cosmotrain.data.formats.sample import (CHANNELS_FIRST, CHANNELS_LAST, DEFAULT_DTYPE,
                                             DEFAULT_LAYOUT, DTYPES, FORMATS, HDF5, INT16_MAX,
                                             LABEL_HINT, LABEL_RANGE, LAYOUTS, NPY, NUM_CHANNELS,
                                             NUM_LABELS, REPLACE_HINT, TFRECORD, Box, VolumeInfo,
                                             check_finite, check_layout, detect_layout,
                                             encode_counts, from_layout, label_problem, to_layout,
                                             volume_problem, volume_shape)
from cosmotrain.errors import UserError

__all__ = [
    "CHANNELS_FIRST", "CHANNELS_LAST", "DEFAULT_DTYPE", "DEFAULT_LAYOUT", "DTYPES",
    "FORMATS", "FORMAT_HINT", "HDF5", "INT16_MAX", "LABELS_DATASET", "LABEL_HINT",
    "LABEL_RANGE", "LAYOUTS", "LAYOUT_ATTR", "NPY", "NUM_CHANNELS", "NUM_LABELS",
    "REPLACE_HINT", "TFRECORD", "VOLUME_DATASET", "Box", "VolumeInfo", "check_finite",
    "check_layout", "detect_layout", "encode_counts", "format_of", "from_layout",
    "label_problem", "probe", "renamed", "read_block", "read_sample", "sample_file",
    "sample_name", "to_layout",
    "volume_problem", "volume_shape", "write_sample",
]

_MODULES: dict[str, ModuleType] = {HDF5: hdf5_sample, TFRECORD: tfrecord_sample,
                                   NPY: npy_sample}


def module(format: str) -> ModuleType:
    """The module implementing ``format`` (``ValueError`` for an unknown name)."""
    if format not in _MODULES:
        raise ValueError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")
    return _MODULES[format]


def format_of(path: Path | str) -> str | None:
    """The format a file's name says it is in (None: not a sample file of any format)."""
    name = Path(path).name
    for format, mod in _MODULES.items():
        if mod.is_sample_name(name):
            return format
    return None


def sample_file(path: Path | str) -> Path:
    """The file holding the sample at ``path``: ``path`` itself, but for the address
    ``<file>#<k>`` of a record in a TFRecord file of several (``tfrecord_sample``)."""
    return tfrecord_sample.sample_file(path)


def sample_name(stem: str, format: str) -> str:
    """The file name of sample ``stem`` in ``format`` (e.g. ``sample_000007.tfrecord``)."""
    return module(format).sample_name(stem)


def renamed(relpath: str, source: str, target: str) -> str:
    """A sample's relative path with the ``source`` format's file name changed to the
    ``target`` format's (``train/a.tfrecord`` -> ``train/a_data.npy``)."""
    path = Path(relpath)
    return str(path.with_name(sample_name(module(source).sample_stem(path.name), target)))


def probe(path: Path, expect: VolumeInfo | None = None,
          format: str | None = None) -> tuple[VolumeInfo, np.ndarray]:
    """Header and labels of one sample file, checked against ``expect`` when given.

    The format is ``expect``'s, else ``format``, else the file name's (HDF5 by default).
    Every problem raises :class:`~cosmotrain.errors.DataError` naming the file.
    """
    chosen = expect.format if expect is not None else format or _named(path)
    return module(chosen).probe(Path(path), expect)


def read_block(path: Path, expect: VolumeInfo, box: Box | None = None,
               origin: tuple[int, int, int] = (0, 0, 0),
               channels: slice = slice(0, NUM_CHANNELS),
               out: np.ndarray | None = None) -> np.ndarray:
    """One hyperslab (``channels`` x ``box`` at ``origin``) in the stored dtype, C, D, H, W.

    The readers' path: the dtype is kept (an int16 block is half the bytes of float32 in
    the preload store and in flight), the labels are not read (the manifest has them),
    and the file must match the dataset's ``expect``-ed shape, dtype and layout.  ``out``
    (C-contiguous, the block's shape and dtype) receives the block.
    """
    return module(expect.format).read_block(Path(path), expect, box, origin, channels, out)


def read_sample(path: Path, layout: str | None = None, box: Box | None = None,
                origin: tuple[int, int, int] = (0, 0, 0),
                format: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read one sample, or one block of it: ``(volume, labels)``, float32 C, D, H, W and ``(4,)``.

    ``box`` (D, H, W slices; None = the whole volume) shifted by ``origin`` selects a
    hyperslab, read in the file's own layout.  ``layout`` overrides the recorded or
    shape-inferred layout of an HDF5 file.  Every problem (unreadable or truncated file,
    missing dataset, wrong shape or dtype, a block outside the volume) raises
    :class:`~cosmotrain.errors.DataError` naming the file.
    """
    chosen = format or _named(path)
    if chosen == HDF5:
        return hdf5_sample.read_sample(Path(path), layout, box, origin)
    info, labels = probe(path, format=chosen)
    block = read_block(path, info, box, origin)
    return np.ascontiguousarray(block, dtype=np.float32), labels


def write_sample(path: Path, volume_cdhw: np.ndarray, labels: np.ndarray, *,
                 format: str = HDF5, layout: str = DEFAULT_LAYOUT, dtype: str = DEFAULT_DTYPE,
                 attrs: Mapping[str, object] | None = None, where: str = "--out",
                 gzip: bool = False) -> Path:
    """Write one sample atomically in ``format`` (NaN labels: unlabelled, left out).

    ``attrs`` (provenance) are kept where the format has room for them (HDF5); ``gzip``
    compresses a TFRecord file as a whole (MLPerf v1.0).  Combinations a format cannot
    hold (a float32 or channels-first TFRecord, gzip outside TFRecord) raise
    :class:`~cosmotrain.errors.UserError`.
    """
    if gzip and format != TFRECORD:
        raise UserError(f"--gzip compresses TFRecord files only, not {format}")
    if format == HDF5:
        return hdf5_sample.write_sample(path, volume_cdhw, labels, layout=layout,
                                        dtype=dtype, attrs=attrs, where=where)
    if format == TFRECORD:
        return tfrecord_sample.write_sample(path, volume_cdhw, labels, layout=layout,
                                            dtype=dtype, where=where, gzip=gzip)
    return module(format).write_sample(path, volume_cdhw, labels, layout=layout,
                                       dtype=dtype, where=where)


def _named(path: Path | str) -> str:
    """The format of a file by its name; HDF5 for a name no format claims (LBANN's sample
    lists may name files anything, and HDF5 was the only format before the others)."""
    return format_of(path) or HDF5
