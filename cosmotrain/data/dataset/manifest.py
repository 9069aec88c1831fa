"""The dataset manifest: files per split, on-disk shape, model-width sub-cubes, labels, means.

A dataset is a directory of sample files (HDF5, MLPerf TFRecord or NVIDIA numpy:
``formats.py``).  :func:`open_manifest` describes it once,
collectively, and every reader works from the result:

- a ``manifest.json`` (written by ``cosmotrain datagen`` or ``cosmotrain preload``) is
  taken as is;
- any other directory is scanned (``scan.py``) and the description is cached as
  ``cosmotrain-manifest.json`` (next to the data when writable, else in the cache
  directory of ``cache.py``); the cache is reused while the directory lists the same files.

Samples are cubes of the model width ``W``.  A file whose volume is wider (a whole
universe, e.g. 512^3) holds ``(U / W)^3`` of them; sample ``g`` of a split is sub-cube
``g % k^3`` of file ``g // k^3``, sub-cubes in C order of their (depth, height, width)
block indices.  Labels (every file) and, for the divide-by-mean transform, per-sample
means come from the cached sample tables (``sample_table.py``), whose entries are read
again for every file whose size or modification time changed.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosmotrain.comm.collective import everyone, on_root, self_comm
from cosmotrain.data.dataset import cache, file_sums, sample_table, scan, unfinished
from cosmotrain.data.formats import interface as formats
from cosmotrain.errors import ConfigError, DataError, UserError, WriteError

MANIFEST_NAME = "manifest.json"
SCAN_CACHE_NAME = "cosmotrain-manifest.json"
REQUIRED_KEYS = ("format_version", "layout", "dtype", "volume_shape", "splits")


@dataclass(frozen=True, eq=False)
class Manifest:
    """What the readers need to know about a dataset, at one model width."""

    root: Path
    source: Path  # the manifest file this came from
    volume: formats.VolumeInfo  # ``full`` on disk (every file)
    width: int  # model width W (samples are 4 x W^3)
    files: Mapping[str, tuple[str, ...]]  # split -> paths relative to root
    labels: Mapping[str, np.ndarray]  # split -> float32 [files, 4]
    means: Mapping[str, np.ndarray] | None = None  # split -> float64 [samples]

    @property
    def disk_width(self) -> int:
        """Width of the volumes on disk (a universe or a sample)."""
        return self.volume.width

    @property
    def cubes_per_axis(self) -> int:
        return self.disk_width // self.width

    @property
    def cubes_per_file(self) -> int:
        return self.cubes_per_axis ** 3

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.files)

    @property
    def sample_shape(self) -> tuple[int, int, int, int]:
        """One sample in memory: C, W, W, W."""
        return (formats.NUM_CHANNELS, self.width, self.width, self.width)

    @property
    def volume_bytes(self) -> int:
        """Bytes of one file's volume as stored."""
        return int(np.prod(self.volume.shape)) * self.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per voxel value as stored (2 for int16, 4 for float32)."""
        return np.dtype(self.volume.dtype).itemsize

    def count(self, split: str) -> int:
        """Samples (model-width cubes) in ``split``."""
        return len(self._files(split)) * self.cubes_per_file

    def locate(self, split: str, index: int) -> tuple[Path, tuple[int, int, int]]:
        """The file holding sample ``index`` of ``split`` and the sub-cube's origin in it."""
        if not 0 <= index < self.count(split):
            raise IndexError(f"sample {index} is outside split '{split}' of "
                             f"{self.count(split)} samples")
        cube = index % self.cubes_per_file
        return (self.root / self._files(split)[index // self.cubes_per_file],
                cube_origins(self.cubes_per_axis, self.width)[cube])

    def targets(self, split: str, indices: np.ndarray) -> np.ndarray:
        """float32 ``[len(indices), 4]``: the labels of those samples (their files')."""
        return self.labels[split][np.asarray(indices, dtype=np.int64) // self.cubes_per_file]

    def unlabelled_files(self, split: str) -> tuple[str, ...]:
        """Files of ``split`` without labels (their label rows are NaN)."""
        missing = np.isnan(self.labels[split]).any(axis=1)
        return tuple(name for name, bad in zip(self._files(split), missing) if bad)

    def require_labels(self, split: str) -> None:
        """Training and validation need labels: name the first file that has none."""
        missing = self.unlabelled_files(split)
        if missing:
            raise everyone(DataError(
                self.root / missing[0], f"has no {self.volume.label_name} labels "
                f"({len(missing)} of the {split} split's files lack them)",
                "train on labelled files; cosmotrain predict reads unlabelled ones"))

    def sample_means(self, split: str, indices: np.ndarray) -> np.ndarray:
        """float64 mean count of each sample (opened with ``means=True``)."""
        if self.means is None:
            raise ValueError("this manifest was opened without means; pass means=True")
        return self.means[split][np.asarray(indices, dtype=np.int64)]

    def to_dict(self) -> dict[str, Any]:
        """The description in ``manifest.json`` format (what staging writes)."""
        return scan.manifest_dict(self.volume, {s: list(f) for s, f in self.files.items()},
                                  generator="cosmotrain.manifest")

    def _files(self, split: str) -> tuple[str, ...]:
        if split not in self.files:
            raise MissingSplit(self.root, split, self.splits)
        return self.files[split]


class MissingSplit(UserError):
    """A split asked for by name that the dataset does not have (every rank alike); the
    caller that took the name from an option can say which (``predict --split``)."""

    def __init__(self, root: Path, split: str, available: tuple[str, ...]) -> None:
        self.root, self.split, self.available = root, split, available
        super().__init__(f"dataset '{root}' has no split '{split}' (its splits: "
                         f"{self.listing})")

    @property
    def listing(self) -> str:
        return ", ".join(self.available) or "none"


@functools.lru_cache(maxsize=16)
def cube_origins(per_axis: int, width: int) -> tuple[tuple[int, int, int], ...]:
    """Origins of the ``per_axis**3`` sub-cubes of a volume, in sample order."""
    return tuple((i * width, j * width, k * width)
                 for i, j, k in itertools.product(range(per_axis), repeat=3))


def open_manifest(root: str | Path, width: int | None, comm: Any = None, *, means: bool = False,
                  cache_dir: str | None = None, format: str = scan.AUTO) -> Manifest:
    """Describe dataset ``root`` at model width ``width`` (collective over ``comm``; None:
    the width of the files, one sample per file).

    Every rank returns the same manifest or raises the same error, printed once: a bad
    sample file found while building the label table (by whichever rank read it) is
    reported on every rank alike, the first bad file in dataset order.
    ``format`` (``data.format``) chooses the files a scan looks for, and must match what a
    ``manifest.json`` describes; ``auto`` takes the format the files are in.
    ``means`` also loads (or computes once and caches) each sample's mean count.
    """
    comm = self_comm(comm)
    root = Path(root)
    source, volume, files = on_root(comm, lambda: _described(root, cache_dir, format))
    width = volume.width if width is None else width  # None: whole files, as on disk
    _check_width(root, volume, width)
    stats = sample_table.file_stats(root, files, volume.format, comm)
    labels = sample_table.file_labels(root, files, volume, stats, comm, cache_dir)
    manifest = Manifest(root, source, volume, width, files, labels)
    if means:
        origins = cube_origins(manifest.cubes_per_axis, width)
        table = sample_table.sample_means(root, files, volume, stats, origins, width, comm,
                                          cache_dir)
        manifest = Manifest(root, source, volume, width, files, labels, table)
    return manifest


def dataset_identity(root: str | Path, cache_dir: str | None = None,
                     format: str = scan.AUTO) -> str:
    """What dataset ``root`` is, whatever its path (``file_sums.identity``: its volume, its
    splits' entries and their labels); rank-local, cheap once the label table is cached."""
    manifest = open_manifest(root, None, self_comm(None), cache_dir=cache_dir, format=format)
    return file_sums.identity(manifest.volume, manifest.files, manifest.labels)


def _described(root: Path, cache_dir: str | None, format: str = scan.AUTO
               ) -> tuple[Path, formats.VolumeInfo, dict[str, tuple[str, ...]]]:
    """Rank 0's part of :func:`open_manifest`: the description, read and checked once."""
    source, description = read_description(root, cache_dir, format)
    volume, files = parse_description(source, description)
    if format != scan.AUTO and volume.format != format:
        raise ConfigError("data.format", f"is {format} but '{source}' describes "
                          f"{volume.format} files", "set data.format: auto, or point "
                          "data.path at the dataset in that format")
    return source, volume, files


def read_description(root: Path, cache_dir: str | None = None, format: str = scan.AUTO
                     ) -> tuple[Path, dict[str, Any]]:
    """``(file, description)``: ``manifest.json``, a still-valid scan cache, or a new scan."""
    if (root / MANIFEST_NAME).is_file():
        return root / MANIFEST_NAME, _read_json(root / MANIFEST_NAME)
    unfinished.check_finished(root)  # a stage or conversion under way: never scanned
    _, listing = scan.discover(root, format)
    cached = cache.find(root, SCAN_CACHE_NAME, cache_dir)
    if cached is not None:
        description = _read_json(cached)
        same_files = {s: scan.listed_files(v["files"]) if isinstance(v.get("files"), list)
                      else None for s, v in description.get("splits", {}).items()} == listing
        if same_files and format in (scan.AUTO, description.get("format", formats.HDF5)) \
                and _still_probed(root, description):
            return cached, description
    description = scan.describe(root, format)
    try:
        target = cache.target(root, SCAN_CACHE_NAME, cache_dir)
        cache.write_json(target, description)
    except (OSError, WriteError):
        target = root  # nowhere to cache it: rescanned next time, not an error
    return target, description


def _still_probed(root: Path, description: Mapping[str, Any]) -> bool:
    """Whether the file whose header fixed a scan's shape, dtype and layout (``probed``:
    name, size, mtime) is unchanged: a dataset rewritten under the same names is
    rescanned, not read against its old shape."""
    probed = description.get("probed")
    if not isinstance(probed, list) or len(probed) != 3:
        return False  # a scan from before the key: rescanned once
    return [*cache.file_stat(formats.sample_file(root / str(probed[0])))] == list(probed[1:])


def parse_description(path: Path, description: Mapping[str, Any]
                      ) -> tuple[formats.VolumeInfo, dict[str, tuple[str, ...]]]:
    """The on-disk volume and the file lists of a manifest, checked for the keys we need."""
    missing = [key for key in REQUIRED_KEYS if key not in description]
    if missing or description["format_version"] != 1:
        problem = f"lacks {', '.join(missing)}" if missing else "has an unknown format_version"
        raise DataError(path, problem, "regenerate it (cosmotrain datagen) or delete it to "
                        "rescan the directory")
    try:
        volume = formats.VolumeInfo(tuple(int(n) for n in description["volume_shape"]),
                                    str(description["dtype"]), str(description["layout"]),
                                    str(description.get("format", formats.HDF5)))
        files = {str(split): tuple(str(f) for f in entry["files"])
                 for split, entry in description["splits"].items()}
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise DataError(path, f"is malformed ({err})", "regenerate it or delete it") from err
    if volume.layout not in formats.LAYOUTS or volume.dtype not in formats.DTYPES or \
            volume.format not in formats.FORMATS:
        raise DataError(path, f"names format {volume.format!r}, layout {volume.layout!r} "
                        f"and dtype {volume.dtype!r}", f"expected one of {formats.FORMATS}, "
                        f"{formats.LAYOUTS} and {formats.DTYPES}")
    problem = formats.volume_problem(volume.shape, volume.layout)
    if problem is not None:
        raise DataError(path, f"volume_shape: {problem}", "regenerate it (cosmotrain "
                        "datagen) or delete it to rescan the directory")
    return volume, files


def _check_width(root: Path, volume: formats.VolumeInfo, width: int) -> None:
    if width < 1 or volume.width % width:
        divisors = [d for d in range(1, volume.width + 1) if volume.width % d == 0][-3:]
        raise ConfigError("model.width", f"{width} does not divide the width {volume.width} "
                          f"of the volumes in '{root}'",
                          f"use a divisor such as {', '.join(map(str, divisors))}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(path, f"cannot be read as JSON: {err}", "regenerate or delete it")
    if not isinstance(data, dict):
        raise DataError(path, "is not a JSON object", "regenerate or delete it")
    return data
