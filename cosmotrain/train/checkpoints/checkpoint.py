"""HDF5 checkpoints: written atomically, checksummed, full arrays in PyTorch layout, K kept.

A checkpoint holds everything a resumed run needs to continue the same trajectory: the
parameters and buffers by PyTorch ``state_dict`` name, the optimizer state, the resolved
config, the step / epoch / samples counters and the RNG (seed) state.  Arrays are *full*
(the caller gathers sharded blocks first), so a checkpoint resumes under any rank count or
parallel strategy and loads into the equivalent ``torch.nn`` model; the layout it was
written under is kept for information only.

File layout (``docs/TRAINING.md`` has the full table)::

    /                  attrs: format, format_version, step, epoch, samples_seen, checksum
    /config            UTF-8 string: the resolved config (YAML)
    /params/<name>     one dataset per parameter, e.g. params/conv1.weight (F, C, kD, kH, kW)
    /buffers/<name>    BN running statistics (num_batches_tracked is a 0-d dataset)
    /optimizer         attrs: optimizer-wide scalars
    /optimizer/<name>  one group per parameter: array slots as datasets, scalar slots
                       (Adam's step) as attrs
    /rng, /layout      attrs only: dicts of scalars

Integrity (format version 2): every dataset carries a ``crc32`` attribute, the CRC-32 of its
data bytes (UTF-8 text for the config), checked as the array is read, so a damaged array is
named.  The root ``checksum`` attribute is the CRC-32 of a canonical listing of every other
attribute (the scalars, the counters, the per-array CRCs) and of every dataset's path,
dtype and shape: it catches a damaged scalar, a changed shape, a missing or extra entry.
CRC-32 (``zlib.crc32``, standard library) runs at ~3.6 GB/s here against ~0.8 GB/s for
``hashlib.blake2b``; it is meant to catch storage and transfer damage (all bursts up to 32
bits, anything else with probability 1 - 2^-32), not tampering.  A version-1 file has no
checksums and loads unverified, so older runs still resume.

Writing is serial: only rank 0 calls :func:`save_checkpoint` (after gathering), every rank
may call :func:`load_checkpoint`.  The file is built in memory (an ``io.BytesIO``) and
written by :func:`cosmotrain.files.atomic.write_bytes_atomically` to ``<name>.tmp`` in the same
directory, fsynced, then renamed over the final name: a full or read-only disk is a
:class:`~cosmotrain.errors.WriteError` (never HDF5's crash in ``flush``), leaves no ``.tmp``
and leaves the previous checkpoints untouched.  A damaged checkpoint is a
:class:`DamagedCheckpoint` (a ``DataError``); :func:`newest_intact_checkpoint` skips those
and returns the newest one that verifies, already loaded.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Union

import h5py
import numpy as np

from cosmotrain.files.atomic import TMP_SUFFIX, hdf5_image, write_bytes_atomically
from cosmotrain.errors import DataError, WriteError
from cosmotrain.train.checkpoints.checksums import (CHECKSUM_ATTR, CRC_ATTR, content_checksum,
                                                     crc32_of, read_scalars)

FORMAT = "cosmotrain-checkpoint"
FORMAT_VERSION = 2
CHECKSUMS_SINCE = 2  # the first format version with checksums; version 1 loads unverified
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^ckpt_step(\d+)\.h5$")
DAMAGED_FIX = ("move it aside to use the checkpoint before it (train --resume skips "
               "damaged checkpoints by itself)")

Scalar = Union[bool, int, float, str]
LOG = logging.getLogger(__name__)


class DamagedCheckpoint(DataError):
    """A checkpoint that cannot be trusted: unreadable, truncated, not a checkpoint at all,
    or failing a checksum.  ``problem`` says what failed, without the path; ``fix`` what to
    do, by default what training does (``predict`` gives its own)."""

    def __init__(self, path: object, problem: str, fix: str = DAMAGED_FIX) -> None:
        self.problem = problem
        super().__init__(path, problem, fix, kind="checkpoint")


@dataclass
class CheckpointState:
    """Everything a checkpoint holds; arrays are full (gathered), host numpy, PyTorch layout.

    ``optimizer`` maps a parameter name to its slots (arrays or scalars, as
    ``Optimizer.state``); ``rng``, ``layout`` and ``optimizer_scalars`` hold scalars only.
    ``format_version`` is the version of the file it was loaded from (a save always writes
    the current :data:`FORMAT_VERSION`).
    """

    step: int
    epoch: int
    samples_seen: int
    params: dict[str, np.ndarray]
    buffers: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)
    optimizer_scalars: dict[str, Scalar] = field(default_factory=dict)
    config_yaml: str = ""
    rng: dict[str, Scalar] = field(default_factory=dict)
    layout: dict[str, Scalar] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION


class FoundCheckpoint(NamedTuple):
    """What :func:`newest_intact_checkpoint` found: the newest checkpoint that loads and
    verifies (``path`` and its loaded ``state``, both None when there is none) and the
    newer ones ``skipped`` as damaged, newest first, each with the reason."""

    path: Path | None
    state: CheckpointState | None
    skipped: list[tuple[Path, str]]


def checkpoint_dir(output_dir: str | Path) -> Path:
    """``<output.dir>/checkpoints``, where the trainer keeps its checkpoints."""
    return Path(output_dir) / CHECKPOINT_DIR


def checkpoint_name(step: int) -> str:
    """``ckpt_step0000123.h5``: zero-padded so listings sort, parsed as an int anyway."""
    return f"ckpt_step{step:07d}.h5"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the finished checkpoints in ``directory``, by step."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def newest_intact_checkpoint(directory: str | Path) -> FoundCheckpoint:
    """The newest checkpoint in ``directory`` that loads and verifies, already loaded.

    Checkpoints are tried from the highest step down; each damaged one (unreadable,
    truncated, failing a checksum) is skipped and reported in ``skipped`` with the reason,
    for the caller to warn about.  Each file is read once: the returned ``state`` is the
    loaded checkpoint.  A checkpoint written by a newer cosmotrain is not damaged: its
    DataError propagates (resuming from an older one would silently lose work).
    """
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return FoundCheckpoint(path, load_checkpoint(path), skipped)
        except DamagedCheckpoint as err:
            skipped.append((path, err.problem))
    return FoundCheckpoint(None, None, skipped)


def save_checkpoint(directory: str | Path, state: CheckpointState,
                    keep_last: int | None = None) -> Path:
    """Write ``state`` atomically as ``<directory>/ckpt_step<step>.h5`` and apply retention.

    Serial: rank 0 only.  ``keep_last`` = K keeps the K checkpoints of highest step up to
    the new one (always including it, see :func:`_prune`); None keeps all.  Nothing is
    deleted before the new file is renamed into place.  The file is built in memory first
    (about its size again in host memory while it is written); a disk that refuses it is a
    :class:`WriteError`, with no ``.tmp`` left and the older checkpoints untouched.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if state.step < 0:
        raise ValueError(f"a checkpoint's step must be >= 0, got {state.step}")
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteError(folder, err) from None
    started = time.perf_counter()
    image = checkpoint_image(state)
    final = write_bytes_atomically(folder / checkpoint_name(state.step), image)
    LOG.debug("checkpoint %s written: %.2f MiB in %.2f s", final, image.nbytes / 2**20,
              time.perf_counter() - started)
    _prune(folder, final, keep_last)
    return final


def checkpoint_image(state: CheckpointState) -> memoryview:
    """The bytes of the checkpoint file of ``state``, built in memory (nothing on disk).

    A bad state (a name with '/', a scalar that is not bool/int/float/str) raises here,
    before any file exists."""
    return hdf5_image(lambda f: fill_checkpoint(f, state))


def fill_checkpoint(f: h5py.File, state: CheckpointState) -> None:
    """Write every field of ``state`` into the empty HDF5 file ``f``, with its checksums."""
    f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION,
                    "step": state.step, "epoch": state.epoch,
                    "samples_seen": state.samples_seen})
    _write_dataset(f, "config", state.config_yaml)
    _write_arrays(f.create_group("params", track_order=True), state.params)
    _write_arrays(f.create_group("buffers", track_order=True), state.buffers)
    opt = f.create_group("optimizer", track_order=True)
    _write_scalars(opt, state.optimizer_scalars)
    for name, slots in state.optimizer.items():
        _write_slots(opt.create_group(_checked_name(name), track_order=True), slots)
    _write_scalars(f.create_group("rng"), state.rng)
    _write_scalars(f.create_group("layout"), state.layout)
    f.attrs[CHECKSUM_ATTR] = content_checksum(f)


def _write_arrays(group: h5py.Group, arrays: Mapping[str, Any]) -> None:
    for name, value in arrays.items():
        _write_dataset(group, name, value)


def _write_dataset(group: h5py.Group, name: str, value: Any) -> None:
    """One dataset with the CRC-32 of its data as its ``crc32`` attribute."""
    if isinstance(value, str):
        ds = group.create_dataset(_checked_name(name), data=value, dtype=h5py.string_dtype())
    else:
        value = np.asarray(value)
        ds = group.create_dataset(_checked_name(name), data=value)
    ds.attrs[CRC_ATTR] = crc32_of(value)


def _write_slots(group: h5py.Group, slots: Mapping[str, Any]) -> None:
    """Array slots become datasets, scalar slots (Adam's ``step``) attributes."""
    for key, value in slots.items():
        if isinstance(value, np.ndarray):
            _write_dataset(group, key, value)
        else:
            _write_scalars(group, {key: value})


def _write_scalars(node: h5py.Group, scalars: Mapping[str, Any]) -> None:
    for key, value in scalars.items():
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (bool, int, float, str)):
            raise TypeError(f"checkpoint scalar {key!r} must be bool, int, float or str, "
                            f"got {type(value).__name__}")
        if isinstance(value, int) and not isinstance(value, bool) and \
                not -2**63 <= value < 2**63:
            raise ValueError(f"checkpoint scalar {key!r} does not fit in 64 bits; store "
                             f"it as a string")
        node.attrs[key] = value


def _checked_name(name: str) -> str:
    """HDF5 reads '/' as a path separator: a name must be one link."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"checkpoint entry name {name!r} is empty or contains '/'")
    return name


def load_checkpoint(path: str | Path) -> CheckpointState:
    """Read a checkpoint and verify its checksums (format version 2 and later).

    A missing file or one written by a newer cosmotrain is a DataError; a corrupt,
    truncated or foreign one, or one failing a checksum, a :class:`DamagedCheckpoint`
    (a DataError) naming the file and what failed: which array, or the metadata.
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(file, "not found", "pass the path of an existing ckpt_step*.h5 file",
                        kind="checkpoint")
    try:
        with h5py.File(file, "r") as f:
            verify = _check_format(file, f) >= CHECKSUMS_SINCE
            if verify:
                _verify_listing(file, f)
            return _Reader(file, verify).state(f)
    except DataError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError, IndexError) as err:
        raise DamagedCheckpoint(file, f"unreadable checkpoint ({_first_line(err)}): it is "
                                f"truncated or corrupt") from None


def _check_format(file: Path, f: h5py.File) -> int:
    if f.attrs.get("format") != FORMAT:
        raise DamagedCheckpoint(file, "not a cosmotrain checkpoint (no format attribute)")
    version = int(f.attrs["format_version"])
    if version > FORMAT_VERSION:
        raise DataError(file, f"format version {version} is newer than this cosmotrain "
                        f"reads ({FORMAT_VERSION})", "upgrade cosmotrain", kind="checkpoint")
    return version


def _verify_listing(file: Path, f: h5py.File) -> None:
    stored = f.attrs.get(CHECKSUM_ATTR)
    if stored is None:
        raise DamagedCheckpoint(file, "checkpoint has no 'checksum' attribute (format "
                                "version 2 requires one)")
    found = content_checksum(f)
    if int(stored) != found:
        raise DamagedCheckpoint(
            file, f"checkpoint metadata fails its checksum (stored crc32 {int(stored):#010x}"
            f", computed {found:#010x}): an entry was added, removed or changed (a scalar, "
            f"a counter, the config's or an array's shape, dtype or checksum)")


@dataclass
class _Reader:
    """Reads datasets, checking each one's CRC-32 as it is read when ``verify``."""

    file: Path
    verify: bool

    def state(self, f: h5py.File) -> CheckpointState:
        opt = f["optimizer"]
        return CheckpointState(
            step=int(f.attrs["step"]), epoch=int(f.attrs["epoch"]),
            samples_seen=int(f.attrs["samples_seen"]),
            params={name: self.array(ds) for name, ds in f["params"].items()},
            buffers={name: self.array(ds) for name, ds in f["buffers"].items()},
            optimizer={name: self.slots(group) for name, group in opt.items()},
            optimizer_scalars=read_scalars(opt),
            config_yaml=self.text(f["config"]),
            rng=read_scalars(f["rng"]), layout=read_scalars(f["layout"]),
            format_version=int(f.attrs["format_version"]))

    def slots(self, group: h5py.Group) -> dict[str, Any]:
        slots: dict[str, Any] = {name: self.array(ds) for name, ds in group.items()}
        slots.update(read_scalars(group))
        return slots

    def array(self, ds: h5py.Dataset) -> Any:
        value = ds[()]
        self._check(ds, value)
        return value

    def text(self, ds: h5py.Dataset) -> str:
        value = ds.asstr()[()]
        self._check(ds, value)
        return value

    def _check(self, ds: h5py.Dataset, value: Any) -> None:
        if not self.verify:
            return
        name = ds.name.lstrip("/")
        stored = ds.attrs.get(CRC_ATTR)
        if stored is None:
            raise DamagedCheckpoint(self.file, f"array '{name}' has no checksum")
        found = crc32_of(value)
        if int(stored) != found:
            raise DamagedCheckpoint(
                self.file, f"array '{name}' fails its checksum (stored crc32 "
                f"{int(stored):#010x}, read {found:#010x}): its data is damaged")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _prune(folder: Path, newest: Path, keep_last: int | None) -> None:
    """Retention after ``newest`` was written: of the checkpoints up to its step, keep the
    ``keep_last`` highest (``newest`` always among them); then remove the ``.tmp``
    leftovers of interrupted writes (only rank 0 ever writes here).

    Checkpoints of a *higher* step than ``newest`` are left alone: a run only writes below
    them after resuming past damaged ones, so they are those damaged files (kept for
    inspection, replaced when the run reaches their step).  They neither count towards
    ``keep_last`` nor push out the good checkpoints below them.
    """
    if keep_last is not None:
        step = int(_NAME.match(newest.name).group(1))  # type: ignore[union-attr]
        found = [p for s, p in list_checkpoints(folder) if s <= step]
        for old in found[:-keep_last]:
            if old != newest:
                LOG.debug("checkpoint %s removed (train.keep_checkpoints: %d)", old, keep_last)
                _unlink(old)
    for leftover in folder.glob(f"ckpt_step*.h5{TMP_SUFFIX}"):
        _unlink(leftover)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        raise WriteError(path, err) from None
