"""Describe a dataset directory that has no ``manifest.json`` (data as downloaded).

Recognised layouts, tried in this order:

1. list files ``train.txt`` / ``validation.txt`` (or ``val.txt``) / ``test.txt``: one path
   per line, relative to the directory (LBANN-style sample lists; ``#`` comments allowed);
2. split directories ``train/`` / ``validation/`` (or ``val/``, ``valid/``) / ``test/``
   holding sample files: ``*.hdf5`` / ``*.h5``, ``*.tfrecord`` (MLPerf HPC, plain or
   gzip), or NVIDIA's ``*_data.npy`` (listed in ``files_data.lst`` when the directory has
   one, with ``files_label.lst`` checked against it);
3. sample files directly in the directory: one ``train`` split.

TFRecord files of several records (the 2019_02 universes, 64 a file) are listed record
by record, as ``<file>#<k>`` addresses (:func:`records_listed`).

The format comes from the file names (``formats.format_of``) unless ``data.format`` names
one; a directory holding the samples of two formats must name one.  Files are taken in
sorted name order (list files: in their order).  The first file fixes the volume shape,
dtype and layout; every other file is checked against it when the sample table is built.
The result is a dictionary in the format of ``cosmotrain datagen``'s manifest
(``generator: cosmotrain.scan``), so every kind of dataset is read by the same code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cosmotrain.data.dataset import cache
from cosmotrain.data.formats import (interface as formats, npy as npy_sample,
                                      tfrecord as tfrecord_sample)
from cosmotrain.errors import DataError

SCAN_GENERATOR = "cosmotrain.scan"
AUTO = "auto"
SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train",), "validation": ("validation", "val", "valid"), "test": ("test",)}
LAYOUT_HINT = ("use a directory with manifest.json, train.txt/validation.txt lists, "
               "train/ and validation/ sub-directories of sample files (*.hdf5, *.tfrecord, "
               "*_data.npy), or sample files")


def discover(root: Path, format: str = AUTO) -> tuple[str, dict[str, list[str]]]:
    """``(how, {split: relative paths})`` for a foreign dataset directory (cheap: no opens).

    ``format`` (``auto`` or a name in ``formats.FORMATS``) limits the files looked for.
    """
    root = Path(root)
    if not root.is_dir():
        problem = "is not a directory" if root.exists() else "does not exist"
        raise DataError(root, problem, "point data.path (or --data) at a dataset directory")
    lists = _from_list_files(root)
    if lists:
        return "list files", lists
    dirs = _from_split_dirs(root, format)
    if dirs:
        return "split directories", dirs
    flat = _sample_files(root, root, format)
    if flat:
        return "flat directory", {"train": flat}
    wanted = "sample files" if format == AUTO else f"{format} sample files"
    raise DataError(root, f"holds no manifest.json and no {wanted}", LAYOUT_HINT)


def dataset_format(splits: dict[str, list[str]], format: str = AUTO,
                   root: Path = Path(".")) -> str:
    """The format of the discovered files (named relative to ``root``): ``format`` when
    forced, else the one their names say (HDF5 for names no format claims, as LBANN lists
    may hold)."""
    if format != AUTO:
        return format
    found = {formats.format_of(name) or formats.HDF5 for names in splits.values()
             for name in names}
    if len(found) > 1:
        raise DataError(root, f"mixes sample files of formats {', '.join(sorted(found))}",
                        "keep one format per dataset, or set data.format to choose one",
                        kind="dataset")
    return found.pop()


def describe(root: Path, format: str = AUTO) -> dict[str, Any]:
    """A manifest dictionary for ``root``: the discovered files and the first file's header."""
    how, splits = discover(root, format)
    chosen = dataset_format(splits, format, root)
    if chosen == formats.TFRECORD:
        splits = records_listed(root, splits)
    first = next(iter(splits.values()))[0]
    info, _ = formats.probe(Path(root) / first, format=chosen)
    stat = cache.file_stat(formats.sample_file(Path(root) / first))
    return manifest_dict(info, splits, generator=SCAN_GENERATOR, source=how,
                         probed=[first, *stat])


def records_listed(root: Path, splits: dict[str, list[str]]) -> dict[str, list[str]]:
    """TFRecord files of several records listed record by record (``<file>#<k>``), when
    the first file holds several: then every file is counted (its framing walked), so a
    dataset of one-record files (MLPerf's) costs the count of one file."""
    first = next(iter(splits.values()))[0]
    if tfrecord_sample.record_address(first)[1] is not None or \
            tfrecord_sample.record_count(Path(root) / first) == 1:
        return splits
    return {split: [entry for name in names for entry in _records_of(root, name)]
            for split, names in splits.items()}


def _records_of(root: Path, name: str) -> list[str]:
    if tfrecord_sample.record_address(name)[1] is not None:
        return [name]  # a list file may address records itself
    return tfrecord_sample.record_addresses(name, tfrecord_sample.record_count(root / name))


def listed_files(entries: list[str]) -> list[str]:
    """The files of a split's sample entries, in order, each once (the listing a scan
    starts from; records' addresses collapse to their file)."""
    return list(dict.fromkeys(str(formats.sample_file(entry)) for entry in entries))


def manifest_dict(info: formats.VolumeInfo, splits: dict[str, list[str]],
                  **extra: Any) -> dict[str, Any]:
    """A manifest in ``cosmotrain datagen``'s format (counts are files) plus ``extra`` keys."""
    hdf5 = ({"volume_dataset": formats.VOLUME_DATASET,
             "labels_dataset": formats.LABELS_DATASET} if info.format == formats.HDF5 else {})
    return {
        "format_version": 1, **extra, "format": info.format, "width": info.width,
        "layout": info.layout, "dtype": info.dtype, **hdf5,
        "volume_shape": list(info.shape), "labels_shape": [formats.NUM_LABELS],
        "splits": {name: {"count": len(files), "files": list(files)}
                   for name, files in splits.items()},
    }


def _from_list_files(root: Path) -> dict[str, list[str]]:
    found = {}
    for split, names in SPLIT_NAMES.items():
        for name in names:
            listing = root / f"{name}.txt"
            if listing.is_file():
                found[split] = _read_list(listing)
                break
    return found


def _from_split_dirs(root: Path, format: str) -> dict[str, list[str]]:
    found = {}
    for split, names in SPLIT_NAMES.items():
        for name in names:
            files = _sample_files(root, root / name, format) if (root / name).is_dir() else []
            if files:
                found[split] = files
                break
    return found


def _read_list(listing: Path) -> list[str]:
    try:
        lines = listing.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(listing, f"cannot be read: {err}", "fix or remove the list file")
    files = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if not files:
        raise DataError(listing, "lists no files", "one sample path per line, or remove it")
    return files


def _sample_files(root: Path, directory: Path, format: str) -> list[str]:
    """The sample files of ``format`` in ``directory``, relative to ``root``: NVIDIA's
    ``files_data.lst`` when there is one, else the names a format claims, sorted."""
    if format in (AUTO, formats.NPY) and (directory / npy_sample.DATA_LIST).is_file():
        return [_relative(root, directory / name) for name in _nvidia_lists(directory)]
    claimed = sorted(path for path in directory.iterdir()
                     if formats.format_of(path.name) is not None and
                     (format == AUTO or formats.format_of(path.name) == format))
    _refuse_irregular(directory, claimed)
    return [_relative(root, path) for path in claimed]


def _refuse_irregular(directory: Path, claimed: list[Path]) -> None:
    """Name the first entry named like a sample that is not a readable regular file (a
    dangling symlink, a directory, a FIFO): dropping it would train on fewer samples
    without a word, as a symlink farm with one purged target would."""
    bad = [(path, kind) for path in claimed if (kind := _irregular(path)) is not None]
    if bad:
        path, kind = bad[0]
        raise DataError(path, f"is {kind}, not a readable sample file ({len(bad)} such "
                        f"entr{'y' if len(bad) == 1 else 'ies'} in '{directory}')",
                        "restore it or move it out of the dataset directory")


def _irregular(path: Path) -> str | None:
    """What ``path`` is when it is not a readable regular file; None when it is one."""
    if path.is_symlink() and not path.exists():
        return f"a dangling symbolic link (to '{os.readlink(path)}')"
    if path.is_dir():
        return "a directory"
    if not path.is_file():
        return "not a regular file (a FIFO, socket or device)"
    if not os.access(path, os.R_OK):
        return "not readable (permission denied)"
    return None


def _nvidia_lists(directory: Path) -> list[str]:
    """``files_data.lst``, checked entry by entry against ``files_label.lst`` if present."""
    data = _read_list(directory / npy_sample.DATA_LIST)
    if not (directory / npy_sample.LABEL_LIST).is_file():
        return data
    labels = _read_list(directory / npy_sample.LABEL_LIST)
    for index, (volume, label) in enumerate(zip(data, labels)):
        expected = npy_sample.label_path(Path(volume)).name
        if Path(label).name != expected:
            raise DataError(directory / npy_sample.LABEL_LIST, f"entry {index + 1} is "
                            f"'{label}' but the labels of '{volume}' are '{expected}'",
                            "list the label files in the order of files_data.lst")
    if len(data) != len(labels):
        raise DataError(directory / npy_sample.LABEL_LIST, f"lists {len(labels)} files but "
                        f"files_data.lst lists {len(data)}", "list one label file per sample")
    return data


def _relative(root: Path, path: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)  # an absolute entry of a list file, outside the dataset directory
