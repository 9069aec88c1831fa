"""``<output.dir>/metrics.jsonl``: one JSON object per line, written by rank 0.

Three kinds of record, each described by a JSON-Schema-style dict in :data:`RECORD_SCHEMAS`
and checked by :func:`validate_record` before it is written, so every line of the file obeys
the documented schema (``docs/TRAINING.md`` shows example lines):

- ``train``: the ``steps`` optimizer steps ending at ``step`` (steps completed, 1-based):
  mean loss, rate, throughput, the mean seconds per step by phase and each rank's memory
  high-water mark;
- ``validation``: MSE and MAE overall and per target of the parameters after ``step``;
- ``summary``: the whole run, written once at the end.

Every record's ``epoch`` is the epoch, counted from 1, that its ``step`` belongs to:
``ceil(step / steps_per_epoch)`` (:func:`epoch_of`).  So a train record carries the epoch
in progress (its last step included), a validation record the epoch just finished (or the
one a run stopped within, for the validation at the end of such a run), and the summary
the epoch of the run's last step.  Checkpoints count differently: their ``epoch`` is the
number of epochs completed, what a resumed run starts from.

Floats that are not finite (a diverged loss) are written as ``null``: strict JSON has no NaN.
A resumed run drops the records after its checkpoint, so the file reads as one uninterrupted
trajectory.  The builders (:func:`train_record`, ...) convert numpy scalars and validate; the
trainer gathers the per-rank values (memory) before calling them.  :class:`MetricsFile` is
the file's observer on the run's bus (``outputs/observers.py``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cosmotrain.files.atomic import FILE_MODE, write_all, write_text_atomically
from cosmotrain.runtime.timers import PHASES
from cosmotrain.errors import DataError, WriteError
from cosmotrain.train.outputs.observers import Observer, RunStart

METRICS_FILE = "metrics.jsonl"
TIME_KEYS = ("compute", *PHASES, "io_wait", "other")
STOP_REASONS = ("completed", "max_steps", "target_mae", "interrupted")

_COUNT = {"type": "integer", "minimum": 0}
_SECONDS = {"type": "number", "minimum": 0}
_MAYBE = {"type": ["number", "null"]}
_VALUES = {"type": "array", "minItems": 1, "items": _MAYBE}
_PER_RANK = {"type": "array", "minItems": 1, "items": _SECONDS}
_TIMES = {"type": "object", "required": list(TIME_KEYS), "additionalProperties": False,
          "properties": dict.fromkeys(TIME_KEYS, _SECONDS)}
IO_KEYS = ("read_mib", "received_mib", "read_mib_per_s")
_IO = {"type": "object", "required": list(IO_KEYS), "additionalProperties": False,
       "properties": dict.fromkeys(IO_KEYS, _SECONDS)}


def _record(kind: str, properties: dict[str, Any]) -> dict[str, Any]:
    common = {"kind": {"const": kind}, "time": _SECONDS, "step": _COUNT, "epoch": _COUNT}
    props = {**common, **properties}
    return {"type": "object", "required": list(props), "additionalProperties": False,
            "properties": props}


RECORD_SCHEMAS: dict[str, dict[str, Any]] = {
    "train": _record("train", {
        "steps": {"type": "integer", "minimum": 1}, "samples": _COUNT, "loss": _MAYBE,
        "lr": _SECONDS, "samples_per_s": _SECONDS, "step_time_s": _SECONDS,
        "time_s": _TIMES, "io": _IO, "memory_hwm_mib": _PER_RANK}),
    "validation": _record("validation", {
        "samples": {"type": "integer", "minimum": 1}, "mse": _MAYBE, "mae": _MAYBE,
        "mse_per_param": _VALUES, "mae_per_param": _VALUES, "wall_s": _SECONDS}),
    "summary": _record("summary", {
        "samples": _COUNT, "ranks": {"type": "integer", "minimum": 1}, "wall_s": _SECONDS,
        "samples_per_s": _SECONDS, "final_loss": _MAYBE, "best_mae": _MAYBE,
        "best_mae_epoch": {"type": ["integer", "null"], "minimum": 0},
        "stop_reason": {"enum": list(STOP_REASONS)}, "time_s": _TIMES,
        "memory_hwm_mib": _PER_RANK}),
}
"""The schema of each record kind (a subset of JSON Schema, checked by validate_record)."""


def validate_record(record: Mapping[str, Any]) -> None:
    """Raise ValueError naming the first field of ``record`` that breaks its kind's schema."""
    kind = record.get("kind") if isinstance(record, Mapping) else None
    if kind not in RECORD_SCHEMAS:
        raise ValueError(f"metrics record: 'kind' must be one of {', '.join(RECORD_SCHEMAS)},"
                         f" got {kind!r}")
    _check(record, RECORD_SCHEMAS[kind], "")
    if kind == "validation" and len(record["mse_per_param"]) != len(record["mae_per_param"]):
        raise ValueError("metrics record: 'mse_per_param' and 'mae_per_param' differ in length")


def _check(value: Any, schema: Mapping[str, Any], path: str) -> None:
    where = f"metrics record: '{path or '<record>'}'"
    if "const" in schema and value != schema["const"]:
        raise ValueError(f"{where} must be {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{where} must be one of {schema['enum']}, got {value!r}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(value, t) for t in types):
            raise ValueError(f"{where} must be {' or '.join(types)}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            raise ValueError(f"{where} must be >= {schema['minimum']}, got {value!r}")
    if isinstance(value, Mapping):
        _check_object(value, schema, path)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise ValueError(f"{where} needs at least {schema['minItems']} items")
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{path}[{i}]")


def _check_object(value: Mapping[str, Any], schema: Mapping[str, Any], path: str) -> None:
    prefix = f"{path}." if path else ""
    props = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in value:
            raise ValueError(f"metrics record: '{prefix}{key}' is missing")
    for key, item in value.items():
        if key not in props:
            if schema.get("additionalProperties", True) is False:
                raise ValueError(f"metrics record: '{prefix}{key}' is not in the schema")
            continue
        _check(item, props[key], f"{prefix}{key}")


def _is_type(value: Any, name: str) -> bool:
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    return isinstance(value, {"string": str, "array": list, "object": Mapping}[name])


def epoch_of(step: int, steps_per_epoch: int) -> int:
    """The ``epoch`` of a record at ``step``: the epoch (from 1) that step belongs to,
    0 before the first step."""
    return -(-int(step) // int(steps_per_epoch))


def finite_or_none(value: Any) -> float | None:
    """A Python float, or None for NaN/inf (strict JSON cannot hold them)."""
    number = float(value)
    return number if math.isfinite(number) else None


def time_breakdown(wall_s: float, phases: Mapping[str, float], io_wait_s: float = 0.0,
                   other_s: float = 0.0) -> dict[str, float]:
    """Split ``wall_s`` into the six record phases; compute is what is left.

    ``phases`` is :meth:`PhaseTimers.take` (halo / allreduce / redistribution waits);
    ``other_s`` is overhead the trainer measured itself (logging, checkpoints).  A phase
    name the schema does not know is counted as other.  compute is clipped at 0.
    """
    times = {key: float(phases.get(key, 0.0)) for key in PHASES}
    extra = sum(float(v) for k, v in phases.items() if k not in PHASES)
    times["io_wait"] = float(io_wait_s)
    times["other"] = float(other_s) + extra
    compute = max(0.0, float(wall_s) - sum(times.values()))
    return {"compute": compute, **times}


def train_record(*, step: int, epoch: int, samples: int, loss: float, lr: float,
                 samples_per_s: float, time_s: Mapping[str, float],
                 memory_hwm_mib: Sequence[float], steps: int = 1,
                 io: Mapping[str, float] | None = None) -> dict[str, Any]:
    """A ``train`` record: means over the ``steps`` steps ending at ``step``.

    ``io``: this rank's data reading for the step (``IO_KEYS``: MiB read from files, MiB
    received from other ranks, the reader's file bandwidth so far); zeros when omitted.
    """
    times = {key: float(time_s[key]) for key in TIME_KEYS}
    io_mib = {key: float((io or {}).get(key, 0.0)) for key in IO_KEYS}
    return _valid({"kind": "train", "time": time.time(), "step": int(step),
                   "epoch": int(epoch), "steps": int(steps), "samples": int(samples),
                   "loss": finite_or_none(loss), "lr": float(lr),
                   "samples_per_s": float(samples_per_s),
                   "step_time_s": sum(times.values()), "time_s": times, "io": io_mib,
                   "memory_hwm_mib": [float(m) for m in memory_hwm_mib]})


def validation_record(*, step: int, epoch: int, samples: int, mse_per_param: Sequence[float],
                      mae_per_param: Sequence[float], wall_s: float) -> dict[str, Any]:
    """A ``validation`` record; the overall MSE and MAE are the means over the targets."""
    mse = [finite_or_none(v) for v in mse_per_param]
    mae = [finite_or_none(v) for v in mae_per_param]
    return _valid({"kind": "validation", "time": time.time(), "step": int(step),
                   "epoch": int(epoch), "samples": int(samples),
                   "mse": finite_or_none(sum(map(float, mse_per_param)) / max(len(mse), 1)),
                   "mae": finite_or_none(sum(map(float, mae_per_param)) / max(len(mae), 1)),
                   "mse_per_param": mse, "mae_per_param": mae, "wall_s": float(wall_s)})


def summary_record(*, step: int, epoch: int, samples: int, ranks: int, wall_s: float,
                   samples_per_s: float, final_loss: float | None, best_mae: float | None,
                   best_mae_epoch: int | None, stop_reason: str, time_s: Mapping[str, float],
                   memory_hwm_mib: Sequence[float]) -> dict[str, Any]:
    """The ``summary`` record: totals of this run (``time_s``: seconds summed over its steps;
    ``samples_per_s`` over its wall time, which restarts with a resumed run)."""
    return _valid({"kind": "summary", "time": time.time(), "step": int(step),
                   "epoch": int(epoch), "samples": int(samples), "ranks": int(ranks),
                   "wall_s": float(wall_s),
                   "samples_per_s": float(samples_per_s),
                   "final_loss": None if final_loss is None else finite_or_none(final_loss),
                   "best_mae": None if best_mae is None else finite_or_none(best_mae),
                   "best_mae_epoch": None if best_mae_epoch is None else int(best_mae_epoch),
                   "stop_reason": stop_reason,
                   "time_s": {key: float(time_s[key]) for key in TIME_KEYS},
                   "memory_hwm_mib": [float(m) for m in memory_hwm_mib]})


def _valid(record: dict[str, Any]) -> dict[str, Any]:
    validate_record(record)
    return record


def memory_hwm_mib() -> float:
    """This process's peak resident memory in MiB (``ru_maxrss``: KiB on Linux, bytes on
    macOS).  Host memory only; device memory is the GPU backend's to report."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def metrics_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / METRICS_FILE


class MetricsLog:
    """Appends validated records to ``metrics.jsonl``, one flushed line each (rank 0 only).

    ``resume_step`` None starts a new file; an int keeps the valid records up to that step
    (the checkpoint resumed from) and drops the rest, including a last line torn by a crash
    (no newline, or not valid JSON).

    Each record goes out as one complete line in one ``os.write`` on an ``O_APPEND``
    descriptor (no user-space buffer: a reader sees it at once).  When the disk refuses it
    (``ENOSPC``, ``EDQUOT``, ``EIO``...), the file is cut back to its last complete line and
    a :class:`WriteError` names the file: a failed write never leaves half a record.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteError(self.path.parent, err) from None
        if resume_step is not None:
            _keep_until(self.path, resume_step)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        if resume_step is None:
            flags |= os.O_TRUNC
        try:
            self._fd: int | None = os.open(self.path, flags, FILE_MODE)
            self._size = os.fstat(self._fd).st_size
        except OSError as err:
            raise WriteError(self.path, err) from None

    def write(self, record: Mapping[str, Any]) -> None:
        """Validate ``record`` and append it as one line, flushed so readers see it now."""
        if self._fd is None:
            raise ValueError(f"metrics log '{self.path}' is closed")
        validate_record(record)
        line = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n")
        self._append(line.encode("utf-8"))

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        try:
            write_all(self._fd, data)
        except OSError as err:
            self._cut_back()
            raise WriteError(self.path, err) from None
        self._size += len(data)

    def _cut_back(self) -> None:
        """Drop the part of a line a failed write left (best effort: the write error is
        what gets reported)."""
        try:
            os.ftruncate(self._fd, self._size)  # type: ignore[arg-type]
        except OSError:
            pass

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsFile(Observer):
    """``metrics.jsonl`` as a member of the run's bus: opened when the run starts (a
    resumed run keeps its records up to the step it resumes from), every record appended
    as it comes, closed when the run stops (or fails)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = metrics_path(output_dir)
        self.log: MetricsLog | None = None

    def run_start(self, run: RunStart) -> None:
        self.log = MetricsLog(self.path, run.first_step if run.resumed else None)

    def record(self, record: Mapping[str, Any]) -> None:
        if self.log is None:
            raise ValueError(f"metrics log '{self.path}' is not open: no run started")
        self.log.write(record)

    def run_stop(self, summary: Mapping[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def _keep_until(path: Path, step: int) -> None:
    """Rewrite ``path`` atomically with only its valid records of step <= ``step``; an old
    summary goes too (the resumed run writes its own), and so does a torn last line (one
    without its newline, even if what is there happens to parse)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as err:
        raise DataError(path, f"cannot be read ({err.strerror or err})",
                        "check the disk or start afresh without --resume",
                        kind="metrics file") from None
    lines = text.split("\n")[:-1]  # the piece after the last newline is torn, or empty
    kept = [line for line in lines
            if (record := _parse(line)) is not None and record["step"] <= step
            and record["kind"] != "summary"]
    if kept == lines and (not text or text.endswith("\n")):
        return  # nothing to drop: no rewrite, no extra space needed
    write_text_atomically(path, "".join(line + "\n" for line in kept))


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
        validate_record(record)
    except (ValueError, TypeError):
        return None
    return record


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """Every record of a metrics file (of one ``kind`` if given); a bad line is a DataError."""
    file = Path(path)
    if not file.is_file():
        raise DataError(file, "not found", "pass <output.dir>/metrics.jsonl",
                        kind="metrics file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(file, f"is not UTF-8 text (byte {err.start} is "
                        f"0x{err.object[err.start]:02x})", "pass the metrics.jsonl a "
                        "cosmotrain run wrote", kind="metrics file") from None
    except OSError as err:
        raise DataError(file, f"cannot be read ({err.strerror or err})", "check the disk",
                        kind="metrics file") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        record = _parse(line)
        if record is None:
            raise DataError(file, f"line {number} is not a valid metrics record",
                            "remove the line or rerun the training", kind="metrics file")
        if kind is None or record["kind"] == kind:
            records.append(record)
    return records
