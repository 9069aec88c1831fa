"""Describe a dataset directory that has no ``manifest.json`` (data from elsewhere).

Recognised layouts, tried in this order:

1. list files ``train.txt`` / ``validation.txt`` (or ``val.txt``) / ``test.txt``: one path
   per line, relative to the directory (LBANN-style sample lists; ``#`` comments allowed);
2. split directories ``train/`` / ``validation/`` (or ``val/``, ``valid/``) / ``test/``
   holding ``*.hdf5`` or ``*.h5`` files (MLPerf, LBANN's split files);
3. ``*.hdf5`` / ``*.h5`` files directly in the directory: one ``train`` split.

Files are taken in sorted name order.  The first file fixes the volume shape, dtype and
layout; every other file is checked against it when the sample table is built.  The result
is a dictionary in the format of ``cosmotrain datagen``'s manifest (``generator:
cosmotrain.scan``), so both kinds of dataset are read by the same code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosmotrain.data import formats
from cosmotrain.errors import DataError

SCAN_GENERATOR = "cosmotrain.scan"
SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train",), "validation": ("validation", "val", "valid"), "test": ("test",)}
SUFFIXES = (".hdf5", ".h5")
LAYOUT_HINT = ("use a directory with manifest.json, train.txt/validation.txt lists, "
               "train/ and validation/ sub-directories of *.hdf5 files, or *.hdf5 files")


def discover(root: Path) -> tuple[str, dict[str, list[str]]]:
    """``(how, {split: relative paths})`` for a foreign dataset directory (cheap: no opens)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(root, "is not a directory", "set data.path to a dataset directory")
    lists = _from_list_files(root)
    if lists:
        return "list files", lists
    dirs = _from_split_dirs(root)
    if dirs:
        return "split directories", dirs
    flat = _hdf5_files(root, root)
    if flat:
        return "flat directory", {"train": flat}
    raise DataError(root, "holds no manifest.json and no HDF5 sample files", LAYOUT_HINT)


def describe(root: Path) -> dict[str, Any]:
    """A manifest dictionary for ``root``: the discovered files and the first file's header."""
    how, splits = discover(root)
    first = next(iter(splits.values()))[0]
    info, _ = formats.probe(Path(root) / first)
    return manifest_dict(info, splits, generator=SCAN_GENERATOR, source=how)


def manifest_dict(info: formats.VolumeInfo, splits: dict[str, list[str]],
                  **extra: Any) -> dict[str, Any]:
    """A manifest in ``cosmotrain datagen``'s format (counts are files) plus ``extra`` keys."""
    return {
        "format_version": 1, **extra, "width": info.width, "layout": info.layout,
        "dtype": info.dtype, "volume_dataset": formats.VOLUME_DATASET,
        "labels_dataset": formats.LABELS_DATASET, "volume_shape": list(info.shape),
        "labels_shape": [formats.NUM_LABELS],
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


def _from_split_dirs(root: Path) -> dict[str, list[str]]:
    found = {}
    for split, names in SPLIT_NAMES.items():
        for name in names:
            files = _hdf5_files(root, root / name) if (root / name).is_dir() else []
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


def _hdf5_files(root: Path, directory: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in directory.iterdir()
                  if path.suffix in SUFFIXES and path.is_file())
