"""Every file of a dataset with its size and CRC-32C: the ``checksums`` of ``manifest.json``.

``cosmotrain preload``, ``convert`` and ``datagen`` compute the checksum of each file they
write while the bytes are at hand (staging: of the bytes copied; conversion and datagen: of
the file read back) and record them in the manifest they write last::

    "checksums": {"algorithm": "crc32c",
                  "files": {"train/sample_000000.hdf5": [16777856, 2711452081], ...}}

CRC-32C (the ``crc32c`` package: the SSE4.2 / ARMv8 instruction) runs at several GiB/s
per core, about ten times zlib's CRC-32; ``benchmarks/bench_checksum.py`` measures both
against reading the file (docs/PERFORMANCE.md).  xxhash, also fast, is no dependency.

The checksums are what ``data.verify`` checks (``verify.py``), and, with the files' names
the volume and the labels, what a dataset *is* (:func:`identity`): the same dataset staged to another
path has the same identity.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.errors import DataError

ALGORITHM = "crc32c"
KEY = "checksums"
CHUNK = 1 << 23  # 8 MiB
Sums = dict[str, tuple[int, int]]  # relative path -> (size, CRC-32C)


def file_crc32c(path: Path) -> int:
    """CRC-32C of a file's bytes, read in 8 MiB chunks."""
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            value = crc32c.crc32c(chunk, value)
    return value


def sum_files(root: Path, names: Iterable[str]) -> Sums:
    """``{name: (size, CRC-32C)}`` of files ``names`` under ``root``; an unreadable one is a
    :class:`DataError` naming it."""
    sums: Sums = {}
    for name in names:
        path = root / name
        try:
            sums[name] = (path.stat().st_size, file_crc32c(path))
        except OSError as err:
            raise DataError(path, f"cannot be read for its checksum: {err}",
                            "check the file and write the dataset again") from err
    return sums


def disk_files(entry: str, format: str) -> list[str]:
    """The files on disk behind one sample entry (a record's address: its file; NVIDIA's
    ``_data.npy``: with its ``_label.npy``), relative names."""
    name = str(formats.sample_file(entry))
    if format == formats.NPY:
        return [name, str(npy_sample.label_path(Path(name)))]
    return [name]


def every_file(files: Mapping[str, Iterable[str]], format: str) -> list[str]:
    """Every file on disk of a dataset's splits, each once, in split order."""
    return list(dict.fromkeys(name for entries in files.values() for entry in entries
                              for name in disk_files(entry, format)))


def entry(sums: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """The manifest's ``checksums`` value for ``sums``."""
    return {"algorithm": ALGORITHM,
            "files": {name: [int(size), int(crc)] for name, (size, crc) in sorted(sums.items())}}


def parse(path: Path, description: Mapping[str, Any]) -> Sums | None:
    """The checksums a manifest records (None when it has none: a scan, an older
    manifest); a malformed value is a :class:`DataError` naming the manifest."""
    value = description.get(KEY)
    if value is None:
        return None
    try:
        if value["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {value['algorithm']!r} is not {ALGORITHM}")
        return {str(name): (int(size), int(crc)) for name, (size, crc) in value["files"].items()}
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise DataError(path, f"has malformed checksums ({err})",
                        "write the dataset again (cosmotrain preload or convert)") from err


def mismatch(root: Path, name: str, expected: tuple[int, int]) -> str | None:
    """Why file ``name`` does not match its recorded ``(size, CRC-32C)``; None when it does."""
    path = root / name
    try:
        size = path.stat().st_size
        if size != expected[0]:
            return f"is {size} bytes but the manifest records {expected[0]}"
        if file_crc32c(path) != expected[1]:
            return "does not match its CRC-32C in manifest.json (its bytes are damaged)"
    except OSError as err:
        return f"cannot be read to verify it: {err}"
    return None


def check(root: Path, name: str, expected: tuple[int, int]) -> None:
    """Raise a :class:`DataError` naming ``root / name`` if it does not match ``expected``."""
    problem = mismatch(root, name, expected)
    if problem is not None:
        raise DataError(root / name, problem, "stage or convert it again from the source "
                        "(cosmotrain preload / convert), or restore the file")


def identity(volume: formats.VolumeInfo, files: Mapping[str, Iterable[str]],
             labels: Mapping[str, np.ndarray]) -> str:
    """What a dataset is, whatever its path: a digest of its volume (shape, dtype, layout),
    its splits' sample entries in order and their labels.  A staged copy (gzip files
    inflated included), or the same files opened under a forced ``data.format`` equal to
    the detected one, have the same identity; a dataset with other files, another order,
    other volumes or other labels (another seed of the generator) does not."""
    digest = hashlib.sha256(json.dumps(
        {"volume": [list(volume.shape), volume.dtype, volume.layout],
         "splits": {split: list(names) for split, names in files.items()}},
        sort_keys=True).encode())
    for split in sorted(labels):
        digest.update(np.ascontiguousarray(labels[split], dtype=np.float32).tobytes())
    return digest.hexdigest()[:16]
