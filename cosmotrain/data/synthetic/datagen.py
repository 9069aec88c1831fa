"""Write a synthetic CosmoFlow dataset: per-sample files, a train/validation split, a manifest.

Layout of ``out_dir`` (``--format hdf5``, the default)::

    train/sample_000000.hdf5 ...        global sample index in the name
    validation/sample_000056.hdf5 ...   the last round(samples * val_fraction) indices
    manifest.json                       written last, atomically, by rank 0

``--format tfrecord`` writes ``sample_000000.tfrecord`` (MLPerf HPC's record; ``--gzip``:
whole-file gzip as in MLPerf v1.0), ``--format npy`` NVIDIA's ``sample_000000_data.npy``
and ``sample_000000_label.npy`` with ``files_data.lst`` / ``files_label.lst`` per split:
the same samples in every format, so tests and users can make fixtures of each.

Under MPI, rank ``r`` of ``size`` generates indices ``r, r + size, ...``.  Each sample depends
only on ``(seed, index, width)``, so the files are byte-for-byte the same for any rank count.
Every rank reaches the same verdict on every error (bad arguments, an existing dataset, a
failed write) and raises the same :class:`UserError`, so no rank is left waiting in a
collective.
"""

from __future__ import annotations

import json
from numbers import Integral, Real
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cosmotrain.files.atomic import write_text_atomically
from cosmotrain.data.dataset import file_sums
from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.data.synthetic import universes as synthetic
from cosmotrain.errors import UserError, WriteError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
TRAIN, VALIDATION = "train", "validation"
SPLITS: tuple[str, ...] = (TRAIN, VALIDATION)
MIN_WIDTH = 8


def validation_count(samples: int, val_fraction: float) -> int:
    """How many samples go to validation: ``round(samples * val_fraction)``, clamped.

    At least 1 when ``samples >= 2`` and ``val_fraction > 0`` (a split asked for is never
    empty), and at most ``samples - 1`` (training is never empty).
    """
    if samples < 2 or val_fraction <= 0.0:
        return 0
    return min(max(round(samples * val_fraction), 1), samples - 1)


def split_of(index: int, samples: int, val_fraction: float) -> str:
    """The split of global sample ``index``: the last indices are validation (deterministic)."""
    return VALIDATION if index >= samples - validation_count(samples, val_fraction) else TRAIN


def sample_relpath(split: str, index: int, format: str = formats.HDF5) -> str:
    """A sample's path relative to the dataset directory, e.g. ``train/sample_000007.hdf5``."""
    return f"{split}/" + formats.sample_name(f"sample_{index:06d}", format)


def check_arguments(
    samples: int, width: int, seed: int, layout: str, dtype: str, val_fraction: float,
    format: str = formats.HDF5, gzip: bool = False,
) -> None:
    """Raise :class:`UserError` for a bad argument; pure, so every rank raises the same one.

    NaN fails the range comparison for ``val_fraction``, as it should.
    """
    if not isinstance(samples, Integral) or samples < 1:
        raise UserError(f"samples must be at least 1, got {samples!r}; pass e.g. --samples 64")
    if not isinstance(width, Integral) or width < MIN_WIDTH or width % 2:
        raise UserError(
            f"width must be an even number >= {MIN_WIDTH}, got {width!r}; pass e.g. --width 32"
        )
    if not isinstance(seed, Integral) or seed < 0:
        raise UserError(f"seed must be a non-negative integer, got {seed!r}; pass e.g. --seed 0")
    if layout not in formats.LAYOUTS:
        raise UserError(f"layout must be one of {', '.join(formats.LAYOUTS)}, got {layout!r}")
    if dtype not in formats.DTYPES:
        raise UserError(f"dtype must be one of {', '.join(formats.DTYPES)}, got {dtype!r}")
    if not (isinstance(val_fraction, Real) and 0.0 <= val_fraction < 1.0):
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction!r}; e.g. 0.125")
    check_format(format, layout, dtype, gzip)


def check_format(format: str, layout: str, dtype: str, gzip: bool) -> None:
    """What a format can hold: TFRecord is MLPerf's int16 channels-last record (and the only
    one gzip applies to)."""
    if format not in formats.FORMATS:
        raise UserError(f"format must be one of {', '.join(formats.FORMATS)}, got {format!r}")
    if format == formats.TFRECORD and (dtype != "int16" or layout != formats.CHANNELS_LAST):
        raise UserError(f"--format tfrecord holds int16 channels-last cubes (MLPerf's "
                        f"record), not {dtype} {layout}: drop --dtype / --layout, or "
                        f"choose --format hdf5 or npy")
    if gzip and format != formats.TFRECORD:
        raise UserError(f"--gzip compresses TFRecord files only; drop it for --format {format}")


def _rank_size(comm: Any) -> tuple[int, int]:
    """``(rank, size)`` of an mpi4py communicator, or ``(0, 1)`` when serial."""
    return (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())


def _agree(comm: Any, error: str | None) -> None:
    """Collective: raise the lowest failing rank's message as :class:`UserError` on every rank.

    The allgather is also the synchronisation point (a barrier) between phases.
    """
    errors = [error] if comm is None else comm.allgather(error)
    first = next((message for message in errors if message), None)
    if first is not None:
        raise UserError(first)


def _existing_samples(out_dir: Path) -> list[Path]:
    """Sample files (finished or temporary) already in the split directories of ``out_dir``."""
    return [path for split in SPLITS for path in sorted((out_dir / split).glob("sample_*"))]


def _prepare_directory(out_dir: Path, overwrite: bool) -> str | None:
    """Rank 0: refuse an existing dataset unless ``overwrite``, clear it, create the split dirs.

    Returns an error message instead of raising so the verdict can be shared with all ranks.
    Sample files without a manifest (an interrupted run) are refused too, so stale samples of
    another seed or size can never mix into the new dataset.  Overwriting removes the old
    manifest first, so a crash midway never leaves a manifest that lies.
    """
    manifest, existing = out_dir / MANIFEST_NAME, _existing_samples(out_dir)
    if manifest.exists() and not overwrite:
        return (f"'{manifest}' already exists: refusing to overwrite a dataset; "
                "choose another --out directory or pass --overwrite")
    if existing and not overwrite:
        return (f"'{out_dir}' already holds {len(existing)} sample files but no manifest "
                "(an interrupted run?); pass --overwrite to replace them or choose another --out")
    try:
        manifest.unlink(missing_ok=True)
        for stale in existing:
            stale.unlink()
        for split in SPLITS:
            (out_dir / split).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot prepare output directory '{out_dir}': {err}; choose a writable --out"
    return None


def _write_samples(
    out_dir: Path, indices: range, samples: int, width: int, seed: int,
    layout: str, dtype: str, val_fraction: float, progress: Callable[[int], None] | None,
    format: str = formats.HDF5, gzip: bool = False,
) -> file_sums.Sums:
    """Generate and write this rank's samples, calling ``progress(n)`` after each one; the
    size and CRC-32C of every file written."""
    sums: file_sums.Sums = {}
    for split in SPLITS:
        (out_dir / split).mkdir(parents=True, exist_ok=True)  # node-local directories too
    for written, index in enumerate(indices, start=1):
        params = synthetic.sample_parameters(seed, index)
        volume = synthetic.generate_volume(params, width, seed, index)
        path = out_dir / sample_relpath(split_of(index, samples, val_fraction), index, format)
        attrs = {"generator": synthetic.GENERATOR_NAME,
                 "generator_version": synthetic.GENERATOR_VERSION, "seed": seed, "index": index}
        formats.write_sample(path, volume, params, format=format, layout=layout, dtype=dtype,
                             attrs=attrs, gzip=gzip)
        relpath = sample_relpath(split_of(index, samples, val_fraction), index, format)
        sums.update(file_sums.sum_files(out_dir, file_sums.disk_files(relpath, format)))
        if progress is not None:
            progress(written)
    return sums


def build_manifest(
    samples: int, width: int, seed: int, layout: str, dtype: str, val_fraction: float,
    format: str = formats.HDF5,
) -> dict[str, Any]:
    """The manifest describing a generated dataset (a pure function of the arguments)."""
    n_val = validation_count(samples, val_fraction)
    ranges = {TRAIN: range(samples - n_val), VALIDATION: range(samples - n_val, samples)}
    splits = {name: {"count": len(r), "files": [sample_relpath(name, i, format) for i in r]}
              for name, r in ranges.items()}
    return {
        "format_version": MANIFEST_VERSION, "format": format,
        "generator": synthetic.GENERATOR_NAME,
        "generator_version": synthetic.GENERATOR_VERSION,
        "seed": seed, "samples": samples, "width": width, "layout": layout, "dtype": dtype,
        "val_fraction": val_fraction,
        "volume_dataset": formats.VOLUME_DATASET, "labels_dataset": formats.LABELS_DATASET,
        "volume_shape": list(formats.volume_shape(width, layout)),
        "labels_shape": [formats.NUM_LABELS],
        "redshifts": list(synthetic.REDSHIFTS), "mean_count": synthetic.MEAN_COUNT,
        "splits": splits,
    }


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` atomically (``manifest.json.tmp`` beside it, then rename);
    a write the disk refuses is a :class:`WriteError` naming it."""
    return write_text_atomically(out_dir / MANIFEST_NAME,
                                 json.dumps(manifest, indent=2) + "\n", where="--out")


def generate_dataset(
    out_dir: Path,
    samples: int,
    width: int,
    seed: int,
    *,
    layout: str = formats.DEFAULT_LAYOUT,
    dtype: str = formats.DEFAULT_DTYPE,
    val_fraction: float = 0.125,
    overwrite: bool = False,
    comm: Any = None,
    progress: Callable[[int], None] | None = None,
    format: str = formats.HDF5,
    gzip: bool = False,
) -> dict[str, Any]:
    """Generate ``samples`` synthetic universes of ``width**3`` in ``out_dir``; return the manifest.

    Collective over ``comm`` (an mpi4py communicator, or None for serial): every rank must
    call it with the same arguments.  Rank ``r`` writes indices ``r, r + size, ...``; rank 0
    prepares the directory first and writes ``manifest.json`` last, after all samples exist.
    """
    check_arguments(samples, width, seed, layout, dtype, val_fraction, format, gzip)
    samples, width, seed, val_fraction = int(samples), int(width), int(seed), float(val_fraction)
    out_dir = Path(out_dir)
    rank, size = _rank_size(comm)
    _agree(comm, _prepare_directory(out_dir, overwrite) if rank == 0 else None)
    error, sums = None, {}
    try:
        sums = _write_samples(out_dir, range(rank, samples, size), samples, width, seed,
                              layout, dtype, val_fraction, progress, format, gzip)
    except UserError as err:  # a WriteError or DataError: names the file and the cause
        error = str(err)
    except OSError as err:
        error = f"cannot write samples under '{out_dir}': {err}; check free space and permissions"
    _agree(comm, error)  # every sample is on disk past this point
    manifest = build_manifest(samples, width, seed, layout, dtype, val_fraction, format)
    parts = [sums] if comm is None else comm.allgather(sums)
    manifest[file_sums.KEY] = file_sums.entry({k: v for part in parts if part
                                                for k, v in part.items()})
    error = None
    if rank == 0:
        try:
            if format == formats.NPY:
                npy_sample.write_npy_lists(out_dir, {split: entry["files"] for split, entry
                                                     in manifest["splits"].items()})
            write_manifest(out_dir, manifest)
        except WriteError as err:
            error = str(err)
    _agree(comm, error)  # the manifest exists on return, on every rank
    return manifest
