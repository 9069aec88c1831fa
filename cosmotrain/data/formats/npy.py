"""NVIDIA's MLPerf CosmoFlow numpy layout: ``<name>_data.npy`` + ``<name>_label.npy``.

Per sample, the volume as a ``.npy`` array (int16 ``[128, 128, 128, 4]``, channels-last,
in NVIDIA's data; any 4-channel cube in either layout and int16 or float32 is accepted)
and the 4 float32 labels as a second ``.npy`` beside it; a split directory lists them in
``files_data.lst`` and ``files_label.lst`` (``scan.py`` reads the lists).  A volume
without its label file reads as unlabelled (NaN labels).

The volume is memory-mapped at the array's offset after the ``.npy`` header, so the direct
reader reads only a rank's hyperslab.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from cosmotrain.files.atomic import write_bytes_atomically, write_text_atomically
from cosmotrain.data.formats.read_errors import NPY_ERRORS, named_on_failure
from cosmotrain.data.formats.sample import (DEFAULT_DTYPE, DEFAULT_LAYOUT, DTYPES, LABEL_NAMES,
                                             NPY, NUM_CHANNELS, VOLUME_NAMES, Box, SampleNames,
                                             VolumeInfo, check_expected, check_finite,
                                             checked_labels, copy_block, detect_layout,
                                             encode_counts, to_layout, volume_problem)
from cosmotrain.errors import DataError

DATA_SUFFIX = "_data.npy"
LABEL_SUFFIX = "_label.npy"
DATA_LIST, LABEL_LIST = "files_data.lst", "files_label.lst"
FORMAT_HINT = ("expected NVIDIA's layout: <name>_data.npy (a C-order [W, W, W, 4] or "
               "[4, W, W, W] int16 or float32 array) and <name>_label.npy (4 float32)")
VOLUME, LABELS = VOLUME_NAMES[NPY], LABEL_NAMES[NPY]
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}


NAMES = SampleNames((DATA_SUFFIX,))  # the volume names the sample; its labels follow it
is_sample_name, sample_name, sample_stem = (NAMES.is_sample_name, NAMES.sample_name,
                                            NAMES.sample_stem)


def label_path(data_path: Path) -> Path:
    """``<name>_label.npy`` beside ``<name>_data.npy``."""
    return data_path.with_name(sample_stem(data_path.name) + LABEL_SUFFIX)


def write_sample(path: Path, volume_cdhw: np.ndarray, labels: np.ndarray, *,
                 layout: str = DEFAULT_LAYOUT, dtype: str = DEFAULT_DTYPE,
                 where: str = "--out") -> Path:
    """Write the volume (then its labels, unless NaN: unlabelled) atomically, each built
    in memory and renamed into place."""
    path = Path(path)
    data = np.ascontiguousarray(encode_counts(to_layout(volume_cdhw, layout), dtype))
    labels = np.asarray(labels, dtype=np.float32)
    if not np.isnan(labels).all():
        write_bytes_atomically(label_path(path), _npy_bytes(labels), where)
    return write_bytes_atomically(path, _npy_bytes(data), where)


def probe(path: Path, expect: VolumeInfo | None = None) -> tuple[VolumeInfo, np.ndarray]:
    """The volume's header (checked against ``expect``) and the labels, without reading
    the volume; a truncated or foreign file raises :class:`DataError` naming it."""
    info = _header(path)[0]
    if expect is not None:
        check_expected(path, info, expect)
    return info, _labels(path)


def read_block(path: Path, expect: VolumeInfo, box: Box | None = None,
               origin: tuple[int, int, int] = (0, 0, 0),
               channels: slice = slice(0, NUM_CHANNELS),
               out: np.ndarray | None = None) -> np.ndarray:
    """One hyperslab in the stored dtype, C, D, H, W, from a memory map of the array."""
    info, offset = _header(path)
    check_expected(path, info, expect)
    try:
        volume = np.memmap(path, dtype=info.dtype, mode="r", offset=offset, shape=info.shape)
    except (OSError, ValueError) as err:
        raise DataError(path, f"cannot be mapped: {err}", FORMAT_HINT) from err
    block = copy_block(path, volume, info, box, origin, channels, out)
    del volume  # unmap now, not whenever the collector runs
    check_finite(path, block, VOLUME)
    return block


def _header(path: Path) -> tuple[VolumeInfo, int]:
    """``(info, offset of the array's bytes)`` from the ``.npy`` header, checked to be a
    whole C-order 4-channel cube of a supported dtype."""
    with named_on_failure(path, NPY_ERRORS, FORMAT_HINT, "is not a readable .npy file"), \
            open(path, "rb") as handle:
        version = np.lib.format.read_magic(handle)
        if version not in _HEADER_READERS:
            raise ValueError(f".npy format version {version} (expected 1.0 or 2.0)")
        shape, fortran, dtype = _HEADER_READERS[version](handle)
        offset = handle.tell()
        size = handle.seek(0, io.SEEK_END)
    if fortran:
        raise DataError(path, "holds a Fortran-order array", "save it in C order "
                        "(numpy.save of a C-contiguous array), or convert the dataset")
    name = dtype.newbyteorder("<").name if dtype.byteorder == ">" else dtype.name
    if name not in DTYPES or dtype.byteorder == ">":
        raise DataError(path, f"{VOLUME} is {dtype.str}", FORMAT_HINT)
    try:
        layout = detect_layout(tuple(shape), name=VOLUME)
    except ValueError as err:
        raise DataError(path, str(err), FORMAT_HINT) from err
    problem = volume_problem(tuple(shape), layout, VOLUME)
    if problem is not None:
        raise DataError(path, problem, FORMAT_HINT)
    expected = offset + int(np.prod(shape)) * dtype.itemsize
    if size != expected:
        raise DataError(path, f"is {size} bytes but its header promises {expected} "
                        f"(truncated or padded)", "replace the file")
    return VolumeInfo(tuple(int(n) for n in shape), name, layout, NPY), offset


def _labels(path: Path) -> np.ndarray:
    """The 4 labels from ``<name>_label.npy``; NaN when there is no label file."""
    labels = label_path(path)
    if not labels.exists():
        return checked_labels(labels, None, LABELS)
    with named_on_failure(labels, NPY_ERRORS, "expected 4 float32 labels",
                          "is not a readable .npy file"):
        values = np.load(labels, allow_pickle=False)
    return checked_labels(labels, np.ravel(values) if values.size == 4 else values, LABELS)


def _npy_bytes(array: np.ndarray) -> memoryview:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getbuffer()


def write_npy_lists(out: Path, files: dict[str, list[str]]) -> None:
    """NVIDIA's ``files_data.lst`` / ``files_label.lst`` in every directory of ``out``
    holding samples (``files``: each split's sample paths relative to ``out``), in the
    splits' order; ``datagen`` and ``convert`` both write them here."""
    listed: dict[Path, list[str]] = {}
    for names in files.values():
        for name in names:
            listed.setdefault(out / Path(name).parent, []).append(Path(name).name)
    for directory, names in listed.items():
        labels = [label_path(Path(name)).name for name in names]
        for listing, lines in ((DATA_LIST, names), (LABEL_LIST, labels)):
            write_text_atomically(directory / listing, "".join(f"{n}\n" for n in lines),
                                  where="--out")
