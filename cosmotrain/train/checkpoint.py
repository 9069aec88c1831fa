"""HDF5 checkpoints: written atomically, full arrays in PyTorch layout, the last K kept.

A checkpoint holds everything a resumed run needs to continue the same trajectory: the
parameters and buffers by PyTorch ``state_dict`` name, the optimizer state, the resolved
config, the step / epoch / samples counters and the RNG (seed) state.  Arrays are *full*
(the caller gathers sharded blocks first), so a checkpoint resumes under any rank count or
parallel strategy and loads into the equivalent ``torch.nn`` model; the layout it was
written under is kept for information only.

File layout (``docs/TRAINING.md`` has the full table)::

    /                  attrs: format, format_version, step, epoch, samples_seen
    /config            UTF-8 string: the resolved config (YAML)
    /params/<name>     one dataset per parameter, e.g. params/conv1.weight (F, C, kD, kH, kW)
    /buffers/<name>    BN running statistics (num_batches_tracked is a 0-d dataset)
    /optimizer         attrs: optimizer-wide scalars
    /optimizer/<name>  one group per parameter: array slots as datasets, scalar slots
                       (Adam's step) as attrs
    /rng, /layout      attrs only: dicts of scalars

Writing is serial: only rank 0 calls :func:`save_checkpoint` (after gathering), every rank
may call :func:`load_checkpoint`.  The file is written to ``<name>.tmp`` in the same
directory, flushed and fsynced, then renamed over the final name; a crash at any point
leaves the previous checkpoints untouched and at worst a ``.tmp`` that
:func:`latest_checkpoint` ignores and the next save removes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import h5py
import numpy as np

from cosmotrain.atomic import TMP_SUFFIX, write_atomically
from cosmotrain.errors import DataError

FORMAT = "cosmotrain-checkpoint"
FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^ckpt_step(\d+)\.h5$")

Scalar = Union[bool, int, float, str]


@dataclass
class CheckpointState:
    """Everything a checkpoint holds; arrays are full (gathered), host numpy, PyTorch layout.

    ``optimizer`` maps a parameter name to its slots (arrays or scalars, as
    ``Optimizer.state``); ``rng``, ``layout`` and ``optimizer_scalars`` hold scalars only.
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


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint with the highest step, or None; ``.tmp`` leftovers never count."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(directory: str | Path, state: CheckpointState,
                    keep_last: int | None = None) -> Path:
    """Write ``state`` atomically as ``<directory>/ckpt_step<step>.h5`` and apply retention.

    Serial: rank 0 only.  ``keep_last`` = K keeps the K checkpoints of highest step (and
    always the one just written); None keeps all.  Nothing is deleted before the new file
    is renamed into place.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if state.step < 0:
        raise ValueError(f"a checkpoint's step must be >= 0, got {state.step}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    final = write_atomically(folder / checkpoint_name(state.step),
                             lambda tmp: write_state(tmp, state))
    _prune(folder, final, keep_last)
    return final


def write_state(path: Path, state: CheckpointState) -> None:
    """Write every field of ``state`` into a new HDF5 file at ``path`` (not atomic)."""
    with h5py.File(path, "w", track_order=True) as f:
        f.attrs.update({"format": FORMAT, "format_version": state.format_version,
                        "step": state.step, "epoch": state.epoch,
                        "samples_seen": state.samples_seen})
        f.create_dataset("config", data=state.config_yaml, dtype=h5py.string_dtype())
        _write_arrays(f.create_group("params", track_order=True), state.params)
        _write_arrays(f.create_group("buffers", track_order=True), state.buffers)
        opt = f.create_group("optimizer", track_order=True)
        _write_scalars(opt, state.optimizer_scalars)
        for name, slots in state.optimizer.items():
            _write_slots(opt.create_group(_checked_name(name), track_order=True), slots)
        _write_scalars(f.create_group("rng"), state.rng)
        _write_scalars(f.create_group("layout"), state.layout)
        f.flush()


def _write_arrays(group: h5py.Group, arrays: Mapping[str, Any]) -> None:
    for name, value in arrays.items():
        group.create_dataset(_checked_name(name), data=np.asarray(value))


def _write_slots(group: h5py.Group, slots: Mapping[str, Any]) -> None:
    """Array slots become datasets, scalar slots (Adam's ``step``) attributes."""
    for key, value in slots.items():
        if isinstance(value, np.ndarray):
            group.create_dataset(_checked_name(key), data=value)
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
    """Read a checkpoint; a missing, corrupt, truncated or foreign file is a DataError."""
    file = Path(path)
    if not file.is_file():
        raise DataError(file, "checkpoint not found",
                        "pass the path of an existing ckpt_step*.h5 file")
    try:
        with h5py.File(file, "r") as f:
            _check_format(file, f)
            return _read_state(f)
    except DataError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise DataError(file, f"unreadable checkpoint ({_first_line(err)})",
                        "it is truncated or corrupt: move it aside to resume from the "
                        "checkpoint before it") from None


def _check_format(file: Path, f: h5py.File) -> None:
    if f.attrs.get("format") != FORMAT:
        raise DataError(file, "not a cosmotrain checkpoint (no format attribute)",
                        "pass a ckpt_step*.h5 file written by cosmotrain")
    version = int(f.attrs["format_version"])
    if version > FORMAT_VERSION:
        raise DataError(file, f"checkpoint format version {version} is newer than this "
                        f"cosmotrain reads ({FORMAT_VERSION})", "upgrade cosmotrain")


def _read_state(f: h5py.File) -> CheckpointState:
    opt = f["optimizer"]
    return CheckpointState(
        step=int(f.attrs["step"]), epoch=int(f.attrs["epoch"]),
        samples_seen=int(f.attrs["samples_seen"]),
        params={name: ds[()] for name, ds in f["params"].items()},
        buffers={name: ds[()] for name, ds in f["buffers"].items()},
        optimizer={name: _read_slots(group) for name, group in opt.items()},
        optimizer_scalars=_read_scalars(opt),
        config_yaml=f["config"].asstr()[()],
        rng=_read_scalars(f["rng"]), layout=_read_scalars(f["layout"]),
        format_version=int(f.attrs["format_version"]))


def _read_slots(group: h5py.Group) -> dict[str, Any]:
    slots: dict[str, Any] = {name: ds[()] for name, ds in group.items()}
    slots.update(_read_scalars(group))
    return slots


def _read_scalars(node: h5py.Group) -> dict[str, Scalar]:
    """Attributes back as Python scalars (h5py returns numpy scalars)."""
    return {key: (value.item() if isinstance(value, np.generic) else value)
            for key, value in node.attrs.items()}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _prune(folder: Path, newest: Path, keep_last: int | None) -> None:
    """Retention: delete all but the ``keep_last`` highest steps, never ``newest``; then the
    ``.tmp`` leftovers of interrupted writes (only rank 0 ever writes here)."""
    if keep_last is not None:
        found = [p for _, p in list_checkpoints(folder)]
        for old in found[:-keep_last]:
            if old != newest:
                old.unlink(missing_ok=True)
    for leftover in folder.glob(f"ckpt_step*.h5{TMP_SUFFIX}"):
        leftover.unlink(missing_ok=True)
