"""``cosmotrain preload``: stage a dataset onto node-local storage before a job.

Each node copies the files its ranks will read into the same local path (``--dest``,
``data.stage_dir``, or ``$TMPDIR/cosmotrain/<dataset name>``):

- ``data.shuffle: global``: the whole dataset (any rank may read any sample);
- ``data.shuffle: local``: only the shards of the sample groups living on the node
  (``order.shard_ranges``), as in MLPerf HPC, where each worker keeps a fixed shard.

The ranks of a node share its files out; each file is copied to a temporary name with a
CRC-32C computed on the way, re-read and compared, checked to be a sample of the dataset's
shape and dtype, then renamed.  A file already staged with the same size and checksum is
kept; a source whose manifest records checksums is checked against them as it is read
(``data.verify``).  NVIDIA's ``_label.npy`` files are staged beside their volumes.  Gzip
TFRecord files (MLPerf v1.0) are staged *inflated*: a plain record can be memory-mapped
and sliced, so the training loop never decompresses a file.  The node's leader takes
down the manifest of an earlier staging first; once every rank is done, it writes the
label (and mean) tables beside the copies, keyed on the copies' own sizes and
modification times, so a job opens the staged directory without touching any file it
lacks, and last ``manifest.json`` with every copy's size and CRC-32C (``file_sums.py``).
A failure on any rank is one verdict, printed once, and leaves no manifest: the
directory is refused as unfinished (``unfinished.py``) until a rerun completes it.  A ``--dest`` holding another dataset's copy
(or anything but a staging of this dataset) is refused before anything is written
(``stage_claim.py``), unless ``--overwrite``, which renames it aside first.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosmotrain.files.atomic import remove_leftovers, write_atomically
from cosmotrain.comm.collective import agree, together
from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.schema import Config
from cosmotrain.data.dataset import cache, file_sums, sample_table
from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.data.readers import order
from cosmotrain.data.formats import tfrecord as tfrecord_sample
from cosmotrain.data.dataset.manifest import MANIFEST_NAME, Manifest
from cosmotrain.data.readers.job_readers import dataset_root, open_dataset
from cosmotrain.data.copies.stage_claim import move_aside, record_source, stage_problem
from cosmotrain.data.dataset.verify import sums_to_check
from cosmotrain.errors import DataError

CHUNK = 1 << 23  # 8 MiB copy buffer
DEST = "--dest"  # the option that chooses where staged files go (WriteError's fix)
GIB = float(1 << 30)
#: A hidden temporary untouched this long before a staging began is a killed copy's
#: leftover (a live copy keeps writing to its own); the successful staging removes it.
LEFTOVER_AGE_S = 60.0


@dataclass
class StagePlan:
    """What this rank copies, and where; from :func:`plan_staging` (collective)."""

    manifest: Manifest
    dest: Path
    mode: str
    node: Any  # communicator of the ranks sharing this node
    mine: list[str]  # relative paths of the files this rank copies
    entries: dict[str, list[str]]  # the samples in each of them (records' addresses)
    moved_aside: Path | None = None  # where --overwrite moved what --dest held
    source_sums: file_sums.Sums | None = None  # data.verify: the source's, checked on copy


@dataclass
class StageReport:
    """Totals over the job (the same on every rank)."""

    dest: Path
    mode: str
    nodes: int
    files: int  # file copies made or verified, all nodes
    bytes: int  # bytes copied, all nodes
    seconds: float  # the slowest rank's copy time
    node_gib_s: float  # bandwidth of the slowest node
    inflated: int = 0  # gzip files staged decompressed, all nodes

    @property
    def aggregate_gib_s(self) -> float:
        return self.bytes / GIB / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        inflated = f" ({self.inflated} inflated from gzip)" if self.inflated else ""
        return (f"staged {self.files} file(s){inflated}, {_size(self.bytes)} copied, to "
                f"{self.dest} on {self.nodes} node(s) ({self.mode} shuffle) in "
                f"{self.seconds:.2f} s: {self.aggregate_gib_s:.2f} GiB/s in all, "
                f"{self.node_gib_s:.2f} GiB/s on the slowest node; checksums verified\n"
                f"train from it with --set data.path={self.dest}")


def default_dest(cfg: Config) -> Path:
    """``data.stage_dir``, else ``$TMPDIR/cosmotrain/<dataset directory name>``."""
    if cfg.data.stage_dir:
        return Path(cfg.data.stage_dir)
    return Path(tempfile.gettempdir()) / "cosmotrain" / dataset_root(cfg).resolve().name


def node_files(manifest: Manifest, batch_size: int, groups: int, node_groups: set[int],
               mode: str) -> list[str]:
    """The sample entries (relative paths, or records' addresses) a node hosting sample
    groups ``node_groups`` (of ``groups``) reads."""
    wanted = []
    for split, files in manifest.files.items():
        if mode == "global":
            wanted += files
            continue
        count, per_file = manifest.count(split), manifest.cubes_per_file
        shards = order.shard_ranges(count, batch_size, groups)
        keep = {i for g in sorted(node_groups) for i in
                range(shards[g][0] // per_file, -(-shards[g][1] // per_file))}
        wanted += [files[i] for i in sorted(keep)]
    return wanted


def plan_staging(cfg: Config, comm: Any, dest: Path | None = None,
                 overwrite: bool = False) -> StagePlan:
    """Open the source dataset and decide this rank's copies (collective); ``overwrite``
    first renames whatever ``dest`` holds aside (``<dest>.previous-<time>``)."""
    from mpi4py import MPI

    manifest = open_dataset(cfg, comm, verify=False)  # every header checked (label table)
    source_sums = sums_to_check(manifest.root, cfg.data.verify, comm)  # checked on copy
    dest = Path(dest) if dest is not None else default_dest(cfg)
    same = dest.resolve() == manifest.root.resolve()
    agree(comm, f"--dest '{dest}' is the dataset itself; choose a node-local directory"
          if same else f"--dest '{dest}' holds the dataset; --overwrite would move it: "
          f"choose a node-local directory" if overwrite and
          manifest.root.resolve().is_relative_to(dest.resolve()) else None)
    layout = resolve_parallel(cfg, comm.Get_size())
    grid = ProcessGrid(comm, layout)
    group = grid.coord("sample")
    grid.free()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    moved = [m for m in comm.allgather(together(comm, lambda: move_aside(dest, DEST)
             if overwrite and node.Get_rank() == 0 else None)) if m is not None]
    agree(comm, stage_problem(dest, manifest.root, manifest.files, DEST)
          if node.Get_rank() == 0 else None)
    node_groups = set(node.allgather(group))
    by_file: dict[str, list[str]] = {}
    for entry in node_files(manifest, cfg.train.batch_size, layout.sample, node_groups,
                            cfg.data.shuffle):
        by_file.setdefault(str(formats.sample_file(entry)), []).append(entry)
    mine = list(by_file)[node.Get_rank()::node.Get_size()]
    return StagePlan(manifest, dest, cfg.data.shuffle, node, mine,
                     {relpath: by_file[relpath] for relpath in mine},
                     moved[0] if moved else None, source_sums)


def run_staging(plan: StagePlan, comm: Any,
                progress: Callable[[int], None] | None = None) -> StageReport:
    """Copy and verify this rank's files, write the node's manifest; totals (collective).

    A failure on any rank (an unreadable source, a full disk) is one verdict on every
    rank, the lowest failing rank's, printed once; no manifest is written then, so a
    half-staged directory is never taken for a dataset."""
    leader = plan.node.Get_rank() == 0
    started = time.time()
    together(comm, lambda: _claim(plan) if leader else None)
    plan.node.Barrier()
    start = time.perf_counter()
    copied, inflated, sums = together(comm, lambda: _stage_files(plan, progress))
    node_sums = {name: s for part in plan.node.allgather(sums) for name, s in part.items()}
    files = {split: list(names) for split, names in plan.manifest.files.items()}
    stats = sample_table.file_stats(plan.dest, files, plan.manifest.volume.format, plan.node)
    together(comm, lambda: write_metadata(plan.manifest, plan.dest, stats, node_sums)
             if leader else None)
    if leader:  # a killed staging's hidden temporaries go, once every copy is in place
        remove_leftovers(plan.dest, min(started, time.time() - LEFTOVER_AGE_S))
    seconds = time.perf_counter() - start
    report = _report(plan, comm, copied, seconds)
    report.inflated = comm.allreduce(inflated)
    return report


def _claim(plan: StagePlan) -> None:
    """The node's leader: record the source, then take down the manifest of an earlier
    staging until this one is complete (its files may be replaced meanwhile), so the
    directory is refused as unfinished (``unfinished.py``) and never read half-staged."""
    record_source(plan.dest, plan.manifest.root, DEST)
    try:
        (plan.dest / MANIFEST_NAME).unlink(missing_ok=True)
    except OSError as err:
        raise DataError(plan.dest / MANIFEST_NAME, f"cannot be replaced: {err}",
                        "check the permissions of the stage directory") from err


def _stage_files(plan: StagePlan, progress: Callable[[int], None] | None
                 ) -> tuple[int, int, file_sums.Sums]:
    """Copy (or inflate) and verify this rank's files; ``(bytes written, files inflated,
    {relative path: (size, CRC-32C)} of the copies)``."""
    copied = inflated = 0
    crcs: dict[Path, int] = {}
    tfrecord = plan.manifest.volume.format == formats.TFRECORD
    npy = plan.manifest.volume.format == formats.NPY
    for done, relpath in enumerate(plan.mine, start=1):
        source, target = plan.manifest.root / relpath, plan.dest / relpath
        if tfrecord and tfrecord_sample.is_gzip(source):
            copied += inflate_verified(source, target, crcs)
            inflated += 1
        else:
            copied += copy_verified(source, target, crcs, _expected(plan, relpath))
        labels = npy_sample.label_path(source)
        if npy and labels.exists():  # NVIDIA's labels travel with their volumes
            label_name = str(npy_sample.label_path(Path(relpath)))
            copied += copy_verified(labels, npy_sample.label_path(target), crcs,
                                    _expected(plan, label_name))
        for entry in plan.entries[relpath]:  # every sample of the copy, its CRCs checked
            formats.probe(plan.dest / entry, plan.manifest.volume)
        if progress is not None:
            progress(done)
    sums = {str(path.relative_to(plan.dest)): (path.stat().st_size, crc)
            for path, crc in crcs.items()}
    return copied, inflated, sums


def _expected(plan: StagePlan, relpath: str) -> tuple[int, int] | None:
    """The source's recorded size and CRC-32C of ``relpath``, if ``data.verify`` checks it."""
    return plan.source_sums.get(relpath) if plan.source_sums else None


def copy_verified(source: Path, target: Path, crcs: dict[Path, int] | None = None,
                  expected: tuple[int, int] | None = None) -> int:
    """Copy ``source`` to ``target`` and verify its CRC-32C; bytes copied (0 if kept).
    ``crcs`` receives ``target``'s CRC-32C; ``expected`` is the source's recorded size and
    CRC-32C (``data.verify``), which the bytes read must match before ``target`` exists.

    The copy goes through a temporary name of this process's own and is renamed once
    verified (:func:`cosmotrain.files.atomic.write_atomically`): nodes staging onto one shared
    directory may copy the same file at once.  A write the disk refuses is a
    :class:`WriteError` naming ``target``; a source that cannot be read, a
    :class:`DataError` naming it.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_file() and target.stat().st_size == source.stat().st_size:
            kept = checksum(target)
            if kept == checksum(source):
                _check_source(source, expected, (target.stat().st_size, kept))
                _note(crcs, target, kept)
                return 0
    except OSError as err:
        raise _not_staged(source, target, err) from err

    size = []

    def copy(tmp: Path) -> None:
        crc = _copy(source, tmp)
        _check_source(source, expected, (tmp.stat().st_size, crc))
        if checksum(tmp) != crc:
            raise DataError(target, "the copy does not match the source's checksum",
                            "check the node-local disk and run cosmotrain preload again")
        size.append(tmp.stat().st_size)
        _note(crcs, target, crc)
    write_atomically(target, copy, where=DEST, unique=True)
    return size[0]


def _check_source(source: Path, expected: tuple[int, int] | None,
                  found: tuple[int, int]) -> None:
    """Raise a :class:`DataError` naming ``source`` if its bytes differ from its record."""
    if expected is not None and tuple(expected) != found:
        raise DataError(source, "does not match its CRC-32C in manifest.json (its bytes "
                        "are damaged); restore it before staging it")


def _note(crcs: dict[Path, int] | None, target: Path, crc: int) -> None:
    if crcs is not None:
        crcs[target] = crc


def inflate_verified(source: Path, target: Path, crcs: dict[Path, int] | None = None) -> int:
    """Stage a gzip file decompressed (as :func:`copy_verified`, which it follows: a
    temporary name, a CRC-32 of what was written, re-read and compared, then renamed);
    bytes written (0 when ``target`` already holds these bytes)."""
    data = tfrecord_sample.inflate(source)  # a damaged stream: DataError naming source
    crc = file_sums.crc32c.crc32c(data)
    _note(crcs, target, crc)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_file() and target.stat().st_size == len(data) and checksum(target) == crc:
            return 0
    except OSError as err:
        raise _not_staged(source, target, err) from err

    def write(tmp: Path) -> None:
        tmp.write_bytes(data)
        if checksum(tmp) != crc:
            raise DataError(target, "the inflated copy does not match what was written",
                            "check the node-local disk and run cosmotrain preload again")
    write_atomically(target, write, where=DEST, unique=True)
    return len(data)


def checksum(path: Path) -> int:
    """CRC-32C of a file's bytes."""
    return file_sums.file_crc32c(path)


def write_metadata(manifest: Manifest, dest: Path, stats: sample_table.Stats,
                   sums: file_sums.Sums | None = None) -> None:
    """The sample tables of ``manifest`` and, last, ``manifest.json`` (with ``sums``, the
    copies' sizes and CRC-32C), written into ``dest`` (by every node's leader: through
    temporary names of its own, as the copies); the tables are keyed on ``stats``, those
    of the staged copies (:func:`sample_table.file_stats`)."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        files = {split: list(names) for split, names in manifest.files.items()}
        sample_table.save_table(dest, sample_table.LABELS_NAME, files, manifest.labels, stats)
        if manifest.means is not None:
            sample_table.save_table(dest, sample_table.means_name(manifest.width), files,
                                    manifest.means, stats)
        description = manifest.to_dict()
        if sums:
            description[file_sums.KEY] = file_sums.entry(sums)
        cache.write_json(dest / MANIFEST_NAME, description, where=DEST)
    except OSError as err:
        raise DataError(dest / MANIFEST_NAME, f"cannot be written: {err}",
                        "check free space and permissions of the stage directory") from err


def _copy(source: Path, target: Path) -> int:
    """Copy ``source`` into ``target``; the CRC-32C of the bytes read.  Reading the source
    fails as a :class:`DataError` (not an ``OSError``: the write of ``target`` is not to
    blame)."""
    crc = 0
    with open(target, "wb") as dst:
        for chunk in _chunks(source, target):
            crc = file_sums.crc32c.crc32c(chunk, crc)
            dst.write(chunk)
    return crc


def _chunks(source: Path, target: Path) -> Iterator[bytes]:
    try:
        with open(source, "rb") as src:
            while chunk := src.read(CHUNK):
                yield chunk
    except OSError as err:
        raise _not_staged(source, target, err) from err


def _not_staged(source: Path, target: Path, err: OSError) -> DataError:
    return DataError(source, f"cannot be staged to '{target}': {err}",
                     "check free space and permissions of the stage directory")


def _report(plan: StagePlan, comm: Any, copied: int, seconds: float) -> StageReport:
    node_bytes = plan.node.allreduce(copied)
    node_seconds = plan.node.allreduce(seconds, op=_max())
    leader = plan.node.Get_rank() == 0
    node_rate = node_bytes / GIB / node_seconds if node_seconds > 0 else 0.0
    rates = [r for r in comm.allgather(node_rate if leader else None) if r is not None]
    plan.node.Free()
    return StageReport(plan.dest, plan.mode, len(rates), comm.allreduce(len(plan.mine)),
                       comm.allreduce(copied), comm.allreduce(seconds, op=_max()),
                       min(rates))


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX
