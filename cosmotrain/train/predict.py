"""``cosmotrain predict``: a checkpoint's per-sample predictions on a dataset, in dataset order.

The model and its input transform come from the resolved config stored in the checkpoint;
the samples from ``--data``, any dataset directory the readers understand, labelled or not
(a file without ``unitPar`` reads as NaN labels).  Prediction runs under any layout: by
default every rank is a sample group and the direct reader streams each split once, never
shuffled; ``--set parallel.depth=2`` (and so on) splits volumes too big for one rank.

Each rank predicts the rows it holds once the model has gathered whole samples; rank 0
collects ``(index, prediction)`` pairs, puts them in dataset order and checks that every
sample came back exactly once, so the file is the same at any rank count.

Output (written atomically; docs/TRAINING.md has the tables): CSV when ``--out`` ends in
``.csv`` (one row per sample: split, file, cube, the predictions, the targets), else HDF5::

    /                   attrs: format, checkpoint, step, data, width, transform
    /<split>/prediction float32 [N, 4]  sample i of the split in row i
    /<split>/target     float32 [N, 4]  the files' unitPar (NaN where a file has none)
    /<split>/file       str [N]         the sample's file, relative to the dataset
    /<split>/cube       int32 [N]       which sub-cube of that file (0 for whole samples)
    /<split>            attrs: count, labelled, mae[4], mse[4], mean_mae (labelled rows)
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import yaml

from cosmotrain.files.previous import refuse_existing_file
from cosmotrain.files.atomic import check_writable, write_hdf5_atomically, write_text_atomically
from cosmotrain.config.load import config_from_mapping, parse_assignment
from cosmotrain.config.layout import sample_groups
from cosmotrain.config.schema import AUTO, Config
from cosmotrain.data.dataset.manifest import Manifest, MissingSplit
from cosmotrain.data.readers.base import Reader
from cosmotrain.errors import UserError, WriteError
from cosmotrain.train.checkpoints.checkpoint import (CheckpointState, DamagedCheckpoint,
                                                      load_checkpoint)
from cosmotrain.train.evaluate import Errors, predictions
from cosmotrain.train.job_setup import Job, build_job
from cosmotrain.train.checkpoints.full_state import restore

FORMAT = "cosmotrain-predictions"
PREDICT_DATA = {"source": "files", "reader": "direct", "shuffle": "global", "drop_last": False}
NOT_A_CHECKPOINT_FIX = ("pass --checkpoint a ckpt_step*.h5 file written by cosmotrain train "
                        "(under output.dir/checkpoints/; an older one there if this one is "
                        "damaged)")


@dataclass
class SplitPredictions:
    """One split's predictions in dataset order, with the labels where files have them."""

    split: str
    prediction: np.ndarray  # float32 [N, outputs]
    target: np.ndarray  # float32 [N, outputs], NaN rows for unlabelled files
    file: list[str]
    cube: np.ndarray  # int32 [N]

    @property
    def labelled(self) -> np.ndarray:
        return ~np.isnan(self.target).any(axis=1)

    def errors(self) -> Errors | None:
        """MSE and MAE per target over the labelled samples (None when there are none)."""
        rows = self.labelled
        if not rows.any():
            return None
        diff = self.prediction[rows].astype(np.float64) - self.target[rows]
        return Errors(int(rows.sum()), (diff ** 2).mean(axis=0), np.abs(diff).mean(axis=0))


def predict_config(config_yaml: str, data: Path, overrides: list[str], world_size: int
                   ) -> Config:
    """The checkpoint's config, reading ``data`` in order, every rank a sample group unless
    ``overrides`` say otherwise; the batch is rounded up to fill the sample groups."""
    raw = yaml.safe_load(config_yaml) or {}
    raw.pop("parallel", None)  # the training layout need not fit this job
    raw.setdefault("data", {}).update(PREDICT_DATA, path=str(data))
    user_batch = any(parse_assignment(item)[0] == "train.batch_size" for item in overrides)
    cfg = config_from_mapping(raw, overrides)
    if cfg.parallel.sample == AUTO and not user_batch:
        groups = sample_groups(cfg, world_size)
        cfg.train.batch_size = -(-cfg.train.batch_size // groups) * groups
    return cfg


def run_prediction(checkpoint: Path, data: Path, out: Path, comm: Any,
                   overrides: list[str] | None = None, splits: list[str] | None = None,
                   overwrite: bool = False) -> dict[str, SplitPredictions] | None:
    """Predict every sample of ``splits`` (default: all) and write ``out`` (collective).

    ``out`` is checked first (rank 0 writes it): a directory, an existing file (unless
    ``overwrite``: another run's predictions are never replaced unasked), or a location
    that cannot be written, fails on every rank before the checkpoint or any data is read.
    Returns the results on rank 0, None elsewhere.
    """
    check_out_collectively(out, comm, overwrite)
    state = load_predict_checkpoint(checkpoint)
    cfg = predict_config(state.config_yaml, data, list(overrides or []), comm.Get_size())
    try:
        job = build_job(cfg, comm, tuple(splits) if splits else None, training=False)
    except MissingSplit as err:
        raise UserError(f"--split {err.split}: dataset '{err.root}' has no such split (its "
                        f"splits: {err.listing}); pass one of them, or leave --split out to "
                        f"predict every split") from None
    try:
        restore(job.step, state.params, state.buffers, {}, str(checkpoint))
        results = {split: collect(job, split, reader) for split, reader in job.readers.items()}
    finally:
        for reader in job.readers.values():
            reader.close()
        job.grid.free()
    if comm.Get_rank() != 0:
        return None
    final = {split: result for split, result in results.items() if result is not None}
    write_predictions(out, final, state, checkpoint, cfg, overwrite)
    return final


def load_predict_checkpoint(checkpoint: Path) -> CheckpointState:
    """:func:`load_checkpoint`, with advice for ``--checkpoint`` when the file is not an
    intact checkpoint (training's advice is about ``--resume``)."""
    try:
        return load_checkpoint(checkpoint)
    except DamagedCheckpoint as err:
        raise DamagedCheckpoint(err.path, err.problem, NOT_A_CHECKPOINT_FIX) from None


def check_out(out: Path, overwrite: bool = False) -> Path:
    """Refuse an ``--out`` that is a directory, that exists (unless ``overwrite``) or
    whose directory cannot be written (created if missing, then probed with a small
    file): UserError / WriteError."""
    out = Path(out)
    refuse_existing_file(out, overwrite, f"an HDF5 file such as {out / 'predictions.h5'} "
                                         f"(or a .csv file)")
    check_writable(out.parent, where="--out")
    return out


def check_out_collectively(out: Path, comm: Any, overwrite: bool = False) -> None:
    """:func:`check_out` on rank 0, its verdict raised alike on every rank (so every rank
    exits 2 and rank 0 prints one line), before any rank does any work."""
    verdict: tuple[Any, ...] | None = None
    if comm.Get_rank() == 0:
        try:
            check_out(out, overwrite)
        except WriteError as err:
            cause = err.reason if err.errno is None else OSError(err.errno, err.reason)
            verdict = ("write", err.path, cause)
        except UserError as err:
            verdict = ("user", str(err))
    if comm.Get_size() > 1:
        verdict = comm.bcast(verdict, root=0)
    if verdict is None:
        return
    if verdict[0] == "write":
        raise WriteError(verdict[1], verdict[2], where="--out", collective=True)
    raise UserError(verdict[1])


def collect(job: Job, split: str, reader: Reader) -> SplitPredictions | None:
    """Run the split and gather ``(index, prediction)`` rows in dataset order on rank 0."""
    outputs = job.cfg.model.outputs
    indices, rows = [np.empty(0, np.int64)], [np.empty((0, outputs), np.float32)]
    for index, prediction, _ in predictions(job.step, reader):
        indices.append(np.asarray(index, np.int64))
        rows.append(np.asarray(prediction, np.float32))
    gathered = job.comm.gather((np.concatenate(indices), np.concatenate(rows)), root=0)
    if gathered is None:
        return None
    index = np.concatenate([i for i, _ in gathered])
    prediction = np.concatenate([p for _, p in gathered])
    order = np.argsort(index, kind="stable")
    count = job.manifest.count(split)
    if not np.array_equal(index[order], np.arange(count)):
        raise RuntimeError(f"split {split!r}: predictions cover {len(np.unique(index))} "
                           f"distinct sample(s) in {len(index)} row(s), expected each of "
                           f"{count} exactly once")
    return in_dataset_order(job.manifest, split, prediction[order])


def in_dataset_order(manifest: Manifest, split: str, prediction: np.ndarray
                     ) -> SplitPredictions:
    """Attach labels and provenance to predictions already in dataset order."""
    samples = np.arange(len(prediction))
    per_file = manifest.cubes_per_file
    names = manifest.files[split]
    return SplitPredictions(split, prediction, manifest.targets(split, samples),
                            [names[i // per_file] for i in samples],
                            (samples % per_file).astype(np.int32))


def write_predictions(out: Path, results: dict[str, SplitPredictions],
                      state: CheckpointState, checkpoint: Path, cfg: Config,
                      overwrite: bool = False) -> Path:
    """Write the prediction file atomically (rank 0): built in memory, then written with
    plain file I/O, so a full or read-only disk is a WriteError and leaves no ``.tmp``.
    A ``.csv`` name gets CSV (:func:`csv_text`), any other HDF5."""
    out = check_out(out, overwrite)
    if out.suffix.lower() == ".csv":
        return write_text_atomically(out, csv_text(results), where="--out")

    def fill(f: h5py.File) -> None:
        f.attrs.update({"format": FORMAT, "format_version": 1,
                        "checkpoint": str(Path(checkpoint).resolve()),
                        "step": state.step, "data": str(Path(cfg.data.path).resolve()),
                        "width": cfg.model.width, "transform": cfg.data.transform})
        for split, result in results.items():
            _write_split(f.create_group(split), result)

    return write_hdf5_atomically(out, fill, where="--out")


def _write_split(group: h5py.Group, result: SplitPredictions) -> None:
    group.create_dataset("prediction", data=result.prediction)
    group.create_dataset("target", data=result.target)
    group.create_dataset("file", data=result.file, dtype=h5py.string_dtype())
    group.create_dataset("cube", data=result.cube)
    group.attrs.update({"count": len(result.prediction),
                        "labelled": int(result.labelled.sum())})
    errors = result.errors()
    if errors is not None:
        group.attrs.update({"mae": errors.mae, "mse": errors.mse,
                            "mean_mae": errors.mean_mae})


def csv_text(results: dict[str, SplitPredictions]) -> str:
    """The predictions as CSV: a header, then one row per sample, splits in turn, each in
    dataset order; float32 values with 9 significant digits (they read back exactly),
    ``nan`` for the targets of unlabelled files."""
    outputs = next(iter(results.values())).prediction.shape[1] if results else 0
    header = ["split", "file", "cube", *(f"prediction_{i}" for i in range(outputs)),
              *(f"target_{i}" for i in range(outputs))]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for split, result in results.items():
        for row in range(len(result.prediction)):
            values = [*result.prediction[row], *result.target[row]]
            writer.writerow([split, result.file[row], int(result.cube[row]),
                             *(f"{float(v):.9g}" for v in values)])
    return buffer.getvalue()


def describe(results: dict[str, SplitPredictions], out: Path) -> list[str]:
    """One line per split: samples, labelled share, MAE per target; then the file."""
    lines = []
    for split, result in results.items():
        errors = result.errors()
        line = f"{split}: {len(result.prediction)} sample(s)"
        if errors is None:
            line += ", no labels (no MAE)"
        else:
            per_target = " ".join(f"{v:.4f}" for v in errors.mae)
            line += (f", {errors.count} labelled: MAE {errors.mean_mae:.4f} "
                     f"(per parameter {per_target})")
        lines.append(line)
    lines.append(f"predictions written to {out}")
    return lines
