"""``cosmotrain convert``: a dataset rewritten in another sample format, verified file by file.

Every split keeps its files, their order and their directory structure; only the file
names change with the format (``train/a.tfrecord`` -> ``train/a.hdf5``).  The volumes
keep their dtype (TFRecord holds int16 only) and, but for TFRecord (channels-last only),
their layout.  The ranks share the files out round-robin; each output is written
atomically, then read back and compared with the source (volume and labels), so a
converted dataset is proven equal to the source before its ``manifest.json``, written last
by rank 0 with the label table beside it and every file's size and CRC-32C in it
(``file_sums.py``), makes it usable.  ``--out`` records its source in
``.cosmotrain-convert.json`` first: until the manifest is there, the directory is refused
as unfinished (``unfinished.py``), and a rerun of the same conversion completes it.

When converting pays: gzip TFRecord files (MLPerf v1.0) are inflated on every read, so a
job that reads them more than once gains from plain TFRecord, .npy or HDF5 (``preload``
also inflates them onto node-local storage, without a second copy on the shared file
system); HDF5 adds the layout attribute and provenance; nothing else changes what a job
reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosmotrain.comm.collective import agree, together
from cosmotrain.data.dataset import cache, file_sums, sample_table, scan
from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.data.dataset.manifest import MANIFEST_NAME, Manifest, open_manifest
from cosmotrain.data.copies.stage_claim import move_aside
from cosmotrain.data.dataset.unfinished import CONVERT_RECORD, recorded
from cosmotrain.errors import DataError, UserError

OUT = "--out"
GIB = float(1 << 30)


@dataclass(frozen=True)
class ConvertReport:
    """Totals over the job (the same on every rank)."""

    out: Path
    format: str
    files: int
    bytes_written: int
    seconds: float

    def describe(self) -> str:
        rate = self.bytes_written / GIB / self.seconds if self.seconds > 0 else 0.0
        size = (f"{self.bytes_written / GIB:.2f} GiB" if self.bytes_written >= GIB
                else f"{self.bytes_written / 2**20:.1f} MiB")
        return (f"converted {self.files} file(s) to {self.format} in {self.out}: {size} "
                f"written in {self.seconds:.1f} s ({rate:.2f} GiB/s), every file read back "
                f"and equal to its source")


def target_volume(source: formats.VolumeInfo, format: str) -> formats.VolumeInfo:
    """What the converted files hold: the source's cubes in ``format`` (TFRecord: int16
    channels-last, the only kind written)."""
    if format == formats.TFRECORD and source.dtype != "int16":
        raise UserError(f"TFRecord holds int16 counts as written (MLPerf's format) but "
                        f"the source's volumes are {source.dtype}: convert to hdf5 or npy "
                        f"instead")
    layout = formats.CHANNELS_LAST if format == formats.TFRECORD else source.layout
    return formats.VolumeInfo(formats.volume_shape(source.width, layout), source.dtype,
                              layout, format)


@dataclass(frozen=True)
class ConvertPlan:
    """What this rank converts, from :func:`plan_conversion` (collective)."""

    manifest: Manifest
    out: Path
    target: formats.VolumeInfo
    gzip: bool
    mine: list[tuple[str, int]]  # (split, file index) this rank converts
    total: int  # files in the dataset
    moved_aside: Path | None = None  # where --overwrite moved what --out held


def plan_conversion(source: Path, out: Path, format: str, comm: Any, *, gzip: bool = False,
                    overwrite: bool = False, source_format: str = scan.AUTO,
                    cache_dir: str | None = None) -> ConvertPlan:
    """Open the source (every file's header checked), check the target format can hold it,
    prepare ``out`` and share the files out (collective over ``comm``)."""
    if gzip and format != formats.TFRECORD:
        raise UserError(f"--gzip compresses TFRecord files only; drop it for --format {format}")
    manifest = open_manifest(source, None, comm, cache_dir=cache_dir, format=source_format)
    target = target_volume(manifest.volume, format)
    moved: list[Path] = []
    agree(comm, _prepare(Path(source), Path(out), overwrite, moved)
          if comm.Get_rank() == 0 else None)
    jobs = [(split, i) for split, names in manifest.files.items() for i in range(len(names))]
    return ConvertPlan(manifest, Path(out), target, gzip,
                       jobs[comm.Get_rank()::comm.Get_size()], len(jobs),
                       comm.bcast(moved[0] if moved else None, root=0))


def run_conversion(plan: ConvertPlan, comm: Any,
                   progress: Callable[[int], None] | None = None) -> ConvertReport:
    """Convert and verify this rank's files; rank 0 then writes the manifest (collective)."""
    start = time.perf_counter()
    written, sums = together(comm, lambda: _convert_files(plan, progress))
    seconds = comm.allreduce(time.perf_counter() - start, op=_max())
    parts = comm.gather(sums, root=0)
    agree(comm, _finish(plan.manifest, plan.out, plan.target,
                        {name: s for part in parts for name, s in part.items()})
          if comm.Get_rank() == 0 else None)
    return ConvertReport(plan.out, plan.target.format + (" (gzip)" if plan.gzip else ""),
                         plan.total, comm.allreduce(written), seconds)


def _convert_files(plan: ConvertPlan, progress: Callable[[int], None] | None
                   ) -> tuple[int, file_sums.Sums]:
    """Convert this rank's files; ``(bytes written, their sizes and CRC-32C)``."""
    manifest, written, sums = plan.manifest, 0, {}
    for done, (split, index) in enumerate(plan.mine, start=1):
        relpath = manifest.files[split][index]
        name = formats.renamed(relpath, manifest.volume.format, plan.target.format)
        written += convert_file(manifest.root / relpath, manifest.volume,
                                manifest.labels[split][index], plan.out / name, plan.target,
                                plan.gzip)
        sums.update(file_sums.sum_files(plan.out, file_sums.disk_files(name,
                                                                       plan.target.format)))
        if progress is not None:
            progress(done)
    return written, sums


def convert_file(source: Path, volume: formats.VolumeInfo, labels: np.ndarray, target: Path,
                 into: formats.VolumeInfo, gzip: bool = False) -> int:
    """Convert one sample file and prove the result equal to it; bytes written."""
    cube = formats.read_block(source, volume)  # stored dtype, C, D, H, W
    target.parent.mkdir(parents=True, exist_ok=True)
    formats.write_sample(target, cube, labels, format=into.format, layout=into.layout,
                         dtype=into.dtype, where=OUT, gzip=gzip)
    labels_back, cube_back = formats.probe(target, into)[1], formats.read_block(target, into)
    if not np.array_equal(cube_back, cube) or \
            not np.array_equal(labels_back, labels, equal_nan=True):
        raise DataError(target, f"does not read back equal to its source '{source}'",
                        "check the output disk and convert again")
    return sum(path.stat().st_size for path in _written(target, into.format))


def _written(target: Path, format: str) -> list[Path]:
    label = npy_sample.label_path(target)
    return [target, label] if format == formats.NPY and label.exists() else [target]


def _prepare(source: Path, out: Path, overwrite: bool, moved: list[Path]) -> str | None:
    """Rank 0: refuse converting into the source or into a used directory (unless
    ``overwrite``, which renames what ``--out`` holds to ``<out>.previous-<time>`` and
    appends that to ``moved``, or an unfinished conversion of the same source, which this
    one completes); record the source in ``--out`` and take down its manifest until the
    conversion is done."""
    if out.resolve() == source.resolve():
        return f"{OUT} '{out}' is the source dataset itself; choose another directory"
    if overwrite and source.resolve().is_relative_to(out.resolve()):
        return f"{OUT} '{out}' holds the source; --overwrite would move it: choose another"
    resuming = recorded(out, CONVERT_RECORD) == str(source.resolve()) and \
        not (out / MANIFEST_NAME).exists()
    if out.is_dir() and any(out.iterdir()) and not overwrite and not resuming:
        return (f"{OUT} '{out}' is not empty: choose a new directory, or pass --overwrite "
                f"to move what it holds aside and start over")
    try:
        moved.extend([kept] if overwrite and (kept := move_aside(out, OUT)) else [])
        out.mkdir(parents=True, exist_ok=True)
        cache.write_json(out / CONVERT_RECORD, {"source": str(source.resolve())}, where=OUT)
        (out / MANIFEST_NAME).unlink(missing_ok=True)  # no manifest that lies, midway
    except (OSError, UserError) as err:
        return f"cannot prepare {OUT} '{out}': {err}; choose a writable directory"
    return None


def _finish(manifest: Manifest, out: Path, target: formats.VolumeInfo,
            sums: file_sums.Sums) -> str | None:
    """Rank 0, once every file is converted: NVIDIA's lists (npy), the label table and,
    last, ``manifest.json`` with every file's size and CRC-32C (``sums``)."""
    files = {split: [formats.renamed(name, manifest.volume.format, target.format)
                     for name in names] for split, names in manifest.files.items()}
    try:
        if target.format == formats.NPY:
            npy_sample.write_npy_lists(out, files)
        stats = sample_table.file_stats(out, files, target.format)  # the new files'
        sample_table.save_table(out, sample_table.LABELS_NAME, files, manifest.labels, stats)
        description = scan.manifest_dict(target, files, generator="cosmotrain.convert",
                                         source=str(manifest.root))
        description[file_sums.KEY] = file_sums.entry(sums)
        cache.write_json(out / MANIFEST_NAME, description, where=OUT)
    except (OSError, UserError) as err:
        return str(err)
    return None


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX
