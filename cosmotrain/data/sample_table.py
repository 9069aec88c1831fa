"""Per-file labels and per-sample means of a dataset: built once, collectively, and cached.

Every rank needs the targets of the whole global batch, and the divide-by-mean transform
needs each sample's mean count, which a rank holding one spatial block cannot compute.
Both are small, so they are gathered once over the whole dataset and cached beside the
manifest (``cache.py``):

- ``cosmotrain-labels.npz``: ``unitPar`` of every file.  Building it opens every file, so
  it also checks every file's header against the dataset's shape, dtype and layout: a bad
  file is reported before training starts, naming the file.
- ``cosmotrain-means-w<W>.npz``: the mean count of every model-width sample (sub-cube),
  only when ``data.transform`` is ``mean`` (it reads the whole dataset once).

The files (the samples, for the means) are shared out round-robin over the ranks; the
first bad file in dataset order, whichever rank met it, is raised as a :class:`DataError`
on every rank alike (collective: printed once, exit code 2).  A cache whose file lists
differ from the manifest's is ignored and rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cosmotrain.comm.collective import collective_error, on_root
from cosmotrain.data import cache, formats
from cosmotrain.errors import UserError, WriteError

LABELS_NAME = "cosmotrain-labels.npz"
SLAB_BYTES = 1 << 26  # the mean pass reads at most 64 MiB at a time

def means_name(width: int) -> str:
    """Cache file of the per-sample means at model width ``width``."""
    return f"cosmotrain-means-w{width}.npz"


def file_labels(root: Path, files: Mapping[str, Sequence[str]], expect: formats.VolumeInfo,
                comm: Any, cache_dir: str | None = None) -> dict[str, np.ndarray]:
    """``{split: float32 [files, 4]}``, from the cache or by probing every file (collective)."""
    def work(split: str, i: int) -> np.ndarray:
        return formats.probe(Path(root) / files[split][i], expect)[1]

    counts = {split: len(names) for split, names in files.items()}
    table = _cached_table(root, LABELS_NAME, files, comm, cache_dir, counts, work)
    return {split: values.reshape(-1, formats.NUM_LABELS).astype(np.float32)
            for split, values in table.items()}


def sample_means(root: Path, files: Mapping[str, Sequence[str]], expect: formats.VolumeInfo,
                 origins: Sequence[tuple[int, int, int]], width: int, comm: Any,
                 cache_dir: str | None = None) -> dict[str, np.ndarray]:
    """``{split: float64 [samples]}``: mean count of each ``width``-cube (the sub-cubes of
    every file at ``origins``, in order), from the cache or by reading them all (collective;
    shared out by sample, so a few big universes still keep every rank busy)."""
    def work(split: str, sample: int) -> float:
        path = Path(root) / files[split][sample // len(origins)]
        return cube_mean(path, expect, origins[sample % len(origins)], width)

    counts = {split: len(names) * len(origins) for split, names in files.items()}
    table = _cached_table(root, means_name(width), files, comm, cache_dir, counts, work)
    return {split: values.reshape(-1).astype(np.float64) for split, values in table.items()}


def cube_mean(path: Path, expect: formats.VolumeInfo, origin: tuple[int, int, int],
              width: int) -> float:
    """Mean count over the 4 channels of the ``width``-cube at ``origin`` (read in slabs)."""
    plane_bytes = formats.NUM_CHANNELS * width * width * np.dtype(expect.dtype).itemsize
    slab = max(1, SLAB_BYTES // plane_bytes)
    total = 0.0
    for start in range(0, width, slab):
        box = (slice(start, min(start + slab, width)), slice(0, width), slice(0, width))
        total += float(formats.read_block(path, expect, box, origin).sum(dtype=np.float64))
    return total / (formats.NUM_CHANNELS * width ** 3)


def _cached_table(root: Path, name: str, files: Mapping[str, Sequence[str]], comm: Any,
                  cache_dir: str | None, counts: Mapping[str, int],
                  work: Callable[[str, int], Any]) -> dict[str, np.ndarray]:
    table = on_root(comm, lambda: _load(root, name, files, cache_dir))
    if table is None:
        table = _collective_pass(counts, comm, work)
        on_root(comm, lambda: save_table(root, name, files, table, cache_dir))
    return table


def _collective_pass(counts: Mapping[str, int], comm: Any,
                     work: Callable[[str, int], Any]) -> dict[str, np.ndarray]:
    """``work(split, i)`` for every item, shared round-robin over the ranks; all get all.

    A user error (a bad file) does not stop a rank's share: every rank gathers every
    failure and raises the first in dataset order, alike (collective: printed once).
    """
    jobs = [(split, i) for split, count in counts.items() for i in range(count)]
    rank, size = comm.Get_rank(), comm.Get_size()
    mine, failure = [], None
    for n, (split, i) in enumerate(jobs[rank::size]):
        try:
            mine.append((split, i, work(split, i)))
        except UserError as err:
            failure = (rank + n * size, type(err).__name__, str(err))
            break  # the rest of my share cannot come before this one in dataset order
    table: dict[str, list[Any]] = {split: [None] * count for split, count in counts.items()}
    failures = []
    for part, failed in comm.allgather((mine, failure)):
        failures += [failed] if failed is not None else []
        for split, i, value in part:
            table[split][i] = value
    if failures:
        _, kind, message = min(failures)
        raise collective_error(kind, message)
    return {split: np.asarray(values) for split, values in table.items()}


def _load(root: Path, name: str, files: Mapping[str, Sequence[str]],
          cache_dir: str | None) -> dict[str, np.ndarray] | None:
    path = cache.find(Path(root), name, cache_dir)
    if path is None:
        return None
    try:
        with np.load(path) as stored:
            if any(str(stored.get(f"key_{split}", "")) != cache.files_key(list(names))
                   for split, names in files.items()):
                return None
            return {split: stored[f"table_{split}"] for split in files}
    except (OSError, ValueError, KeyError):
        return None  # an unreadable cache is rebuilt, never fatal


def save_table(root: Path, name: str, files: Mapping[str, Sequence[str]],
               table: Mapping[str, np.ndarray], cache_dir: str | None = None) -> None:
    """Cache ``table`` (one array per split) for dataset ``root``; never fails the job."""
    arrays = {f"table_{split}": values for split, values in table.items()}
    arrays.update({f"key_{split}": np.array(cache.files_key(list(names)))
                   for split, names in files.items()})
    try:
        cache.write_npz(cache.target(Path(root), name, cache_dir), arrays)
    except (OSError, WriteError):
        pass  # no writable cache location: the table is rebuilt next time, not an error
