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
on every rank alike (collective: printed once, exit code 2).

A table stores, beside its values, the size and modification time (ns) of every file it
read, and of each NVIDIA ``_label.npy`` beside its volume (:func:`file_stats`, taken
collectively at every open: one ``stat`` per file, shared out over the ranks).  Entries
whose file changed since (replaced, rewritten, its labels removed) are read again, only
those, as ``make`` and rsync's quick check decide (a same-size rewrite within the file
system's timestamp tick goes unseen).  A table whose file list differs from the
manifest's is rebuilt whole; one written before the stats were stored is read again for
every file present (the absent ones of a local-shuffle stage keep their entries).
Writers of a table for files they just wrote (staging, ``convert``) store the stats of
those files, so a staged copy's new modification times do not invalidate its table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cosmotrain.comm.collective import collective_error, on_root, self_comm
from cosmotrain.data.dataset import cache
from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.errors import UserError, WriteError

LABELS_NAME = "cosmotrain-labels.npz"
SLAB_BYTES = 1 << 26  # the mean pass reads at most 64 MiB at a time
STAT_FIELDS = 4  # size and mtime (ns) of a sample file, then of its label file (-1: none)

Stats = Mapping[str, np.ndarray]  # split -> int64 [files, STAT_FIELDS]
Todo = Mapping[str, Sequence[int]]  # split -> indices of the entries to (re)compute

def means_name(width: int) -> str:
    """Cache file of the per-sample means at model width ``width``."""
    return f"cosmotrain-means-w{width}.npz"


def file_stats(root: Path, files: Mapping[str, Sequence[str]], format: str,
               comm: Any = None) -> dict[str, np.ndarray]:
    """``{split: int64 [files, 4]}``: size and mtime (ns) of every file, then of its
    ``_label.npy`` for the ``npy`` format; -1 where a file is missing (collective: each
    rank stats a share, every rank gets all)."""
    comm = self_comm(comm)
    jobs = [(split, i) for split, names in files.items() for i in range(len(names))]
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = np.array([_stat_row(Path(root) / files[split][i], format)
                     for split, i in jobs[rank::size]], dtype=np.int64)
    every = np.empty((len(jobs), STAT_FIELDS), dtype=np.int64)
    for r, part in enumerate(comm.allgather(mine.reshape(-1, STAT_FIELDS))):
        every[r::size] = part
    stats, start = {}, 0
    for split, names in files.items():
        stats[split], start = every[start:start + len(names)], start + len(names)
    return stats


def _stat_row(path: Path, format: str) -> tuple[int, ...]:
    label = npy_sample.label_path(path) if format == formats.NPY else None
    return cache.file_stat(formats.sample_file(path)) + (cache.file_stat(label) if label
                                                         else (-1, -1))


def file_labels(root: Path, files: Mapping[str, Sequence[str]], expect: formats.VolumeInfo,
                stats: Stats, comm: Any, cache_dir: str | None = None
                ) -> dict[str, np.ndarray]:
    """``{split: float32 [files, 4]}``, from the cache or by probing the files it lacks or
    that changed since (``stats``: :func:`file_stats`; collective)."""
    def work(split: str, i: int) -> np.ndarray:
        return formats.probe(Path(root) / files[split][i], expect)[1]

    table = _cached_table(root, LABELS_NAME, files, stats, 1, comm, cache_dir, work)
    return {split: values.reshape(-1, formats.NUM_LABELS).astype(np.float32)
            for split, values in table.items()}


def sample_means(root: Path, files: Mapping[str, Sequence[str]], expect: formats.VolumeInfo,
                 stats: Stats, origins: Sequence[tuple[int, int, int]], width: int,
                 comm: Any, cache_dir: str | None = None) -> dict[str, np.ndarray]:
    """``{split: float64 [samples]}``: mean count of each ``width``-cube (the sub-cubes of
    every file at ``origins``, in order), from the cache or by reading those it lacks or
    whose file changed (collective; shared out by sample, so a few big universes still
    keep every rank busy)."""
    def work(split: str, sample: int) -> float:
        path = Path(root) / files[split][sample // len(origins)]
        return cube_mean(path, expect, origins[sample % len(origins)], width)

    table = _cached_table(root, means_name(width), files, stats, len(origins), comm,
                          cache_dir, work)
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


def _cached_table(root: Path, name: str, files: Mapping[str, Sequence[str]], stats: Stats,
                  per_file: int, comm: Any, cache_dir: str | None,
                  work: Callable[[str, int], Any]) -> dict[str, np.ndarray]:
    """The table ``name`` (``per_file`` entries a file), its missing or stale entries
    computed by ``work`` over the ranks and the result cached (collective)."""
    stored, todo = on_root(comm, lambda: _load(root, name, files, stats, per_file,
                                               cache_dir))
    if not any(todo.values()):
        return stored
    table = _merge(stored, _collective_pass(todo, comm, work))
    on_root(comm, lambda: save_table(root, name, files, table, stats, cache_dir))
    return table


def _collective_pass(todo: Todo, comm: Any, work: Callable[[str, int], Any]
                     ) -> dict[str, dict[int, Any]]:
    """``work(split, i)`` for every entry of ``todo``, shared round-robin over the ranks;
    all get all.

    A user error (a bad file) does not stop a rank's share: every rank gathers every
    failure and raises the first in dataset order, alike (collective: printed once).
    """
    jobs = [(split, i) for split, indices in todo.items() for i in indices]
    rank, size = comm.Get_rank(), comm.Get_size()
    mine, failure = [], None
    for n, (split, i) in enumerate(jobs[rank::size]):
        try:
            mine.append((split, i, work(split, i)))
        except UserError as err:
            failure = (rank + n * size, type(err).__name__, str(err))
            break  # the rest of my share cannot come before this one in dataset order
    fresh: dict[str, dict[int, Any]] = {split: {} for split in todo}
    failures = []
    for part, failed in comm.allgather((mine, failure)):
        failures += [failed] if failed is not None else []
        for split, i, value in part:
            fresh[split][i] = value
    if failures:
        _, kind, message = min(failures)
        raise collective_error(kind, message)
    return fresh


def _merge(stored: Mapping[str, np.ndarray], fresh: Mapping[str, Mapping[int, Any]]
           ) -> dict[str, np.ndarray]:
    """``stored`` with the ``fresh`` entries written in; a split ``stored`` lacks is made
    of fresh entries only (it was computed whole)."""
    table = {}
    for split, values in fresh.items():
        if split in stored:
            table[split] = stored[split].copy()
            for i, value in values.items():
                table[split][i] = value
        else:
            table[split] = np.asarray([values[i] for i in range(len(values))])
    return table


def _load(root: Path, name: str, files: Mapping[str, Sequence[str]], stats: Stats,
          per_file: int, cache_dir: str | None
          ) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
    """``(table, todo)``: the usable part of the cached table (splits whose file list and
    size match) and, per split, the entries to compute: all of a split the cache lacks,
    else those of the files whose stats changed."""
    usable, todo = {}, {}
    for split, names in files.items():
        count = len(names) * per_file
        stored = _stored_split(root, name, split, names, cache_dir)
        if count == 0:
            usable[split], todo[split] = np.zeros(0), []
            continue
        if stored is None or len(stored[0]) != count:
            todo[split] = list(range(count))
            continue
        usable[split] = stored[0]
        changed = _changed_files(stored[1], stats[split])
        todo[split] = [f * per_file + k for f in changed.tolist() for k in range(per_file)]
    return usable, todo


def _changed_files(stored: np.ndarray | None, now: np.ndarray) -> np.ndarray:
    """Indices of the files whose entries must be read again: those whose stats differ;
    for a table from before the stats (``stored`` None), every file present (a file
    absent here, as a local-shuffle stage lacks most, keeps its stored entry)."""
    if stored is None or stored.shape != now.shape:
        return np.flatnonzero(now[:, 0] >= 0)
    return np.flatnonzero((stored != now).any(axis=1))


def _stored_split(root: Path, name: str, split: str, names: Sequence[str],
                  cache_dir: str | None) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``(values, stats)`` of ``split`` in the cached table, if it holds this file list
    (stats None: a table written before they were stored)."""
    path = cache.find(Path(root), name, cache_dir)
    if path is None:
        return None
    try:
        with np.load(path) as stored:
            if str(stored.get(f"key_{split}", "")) != cache.files_key(list(names)):
                return None  # another file list
            stats = stored[f"stat_{split}"] if f"stat_{split}" in stored else None
            return stored[f"table_{split}"], stats
    except (OSError, ValueError, KeyError):
        return None  # an unreadable cache is rebuilt, never fatal


def save_table(root: Path, name: str, files: Mapping[str, Sequence[str]],
               table: Mapping[str, np.ndarray], stats: Stats,
               cache_dir: str | None = None) -> None:
    """Cache ``table`` (one array per split) for dataset ``root``, valid for the files of
    ``stats`` (:func:`file_stats`); never fails the job."""
    arrays = {f"table_{split}": values for split, values in table.items()}
    arrays.update({f"key_{split}": np.array(cache.files_key(list(names)))
                   for split, names in files.items()})
    arrays.update({f"stat_{split}": np.asarray(stats[split], dtype=np.int64)
                   for split in files})
    try:
        cache.write_npz(cache.target(Path(root), name, cache_dir), arrays)
    except (OSError, WriteError):
        pass  # no writable cache location: the table is rebuilt next time, not an error
