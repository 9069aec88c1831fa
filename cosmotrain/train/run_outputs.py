"""Another run's outputs in ``output.dir``: found, refused, or moved aside.

:func:`check_fresh_directory` keeps a new run out of a directory that holds another run's
outputs (checkpoints, ``metrics.jsonl``): refused, or with ``overwrite`` moved aside into
``previous-<timestamp>/``, never deleted.  Anything else there (``data/``, config files)
stays where it is.  Rank 0 calls it holding the run lock (:mod:`cosmotrain.train.rundir`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from cosmotrain.atomic import fsync_path, write_text_atomically
from cosmotrain.train.checkpoint import CHECKPOINT_DIR, list_checkpoints
from cosmotrain.train.metrics import METRICS_FILE
from cosmotrain.train.mlperf_file import MLPERF_LOG, staging_tail
from cosmotrain.train.rundir import RunDirError
from cosmotrain.train.tensorboard_log import TENSORBOARD_DIR

CONFIG_FILE = "config.yaml"
#: a previous run's outputs, moved aside together by ``overwrite`` (in this order)
RUN_OUTPUTS = (CHECKPOINT_DIR, METRICS_FILE, CONFIG_FILE, TENSORBOARD_DIR)
MODES = ("fresh", "resume", "overwrite")


@dataclass(frozen=True)
class RunOutputs:
    """What of a run ``out_dir`` holds: its checkpoints and whether it has metrics."""

    checkpoints: int
    metrics: bool

    @property
    def any(self) -> bool:
        return self.checkpoints > 0 or self.metrics

    def describe(self) -> str:
        """``3 checkpoints, metrics.jsonl``."""
        parts = []
        if self.checkpoints:
            parts.append(f"{self.checkpoints} checkpoint" + "s" * (self.checkpoints != 1))
        if self.metrics:
            parts.append(METRICS_FILE)
        return ", ".join(parts)


@dataclass(frozen=True)
class MovedAside:
    """A previous run's outputs moved into ``dest`` by ``overwrite``."""

    dest: Path
    names: tuple[str, ...]  # as they were named in out_dir (directories with a slash)

    def note(self) -> str:
        return (f"cosmotrain: moved the previous run's outputs ({', '.join(self.names)}) to "
                f"{self.dest}/")


def find_run_outputs(out_dir: str | Path) -> RunOutputs:
    """Count the run outputs in ``out_dir``: finished checkpoints, a non-empty
    ``metrics.jsonl`` (an empty one is what a run that wrote nothing leaves)."""
    out = Path(out_dir)
    count = len(list_checkpoints(out / CHECKPOINT_DIR))
    metrics = out / METRICS_FILE
    return RunOutputs(count, metrics.is_file() and metrics.stat().st_size > 0)


def check_fresh_directory(out_dir: str | Path, mode: str, *, now: float | None = None
                          ) -> MovedAside | None:
    """Make sure a new run does not mix with another run's outputs in ``out_dir``.

    ``mode``: ``resume`` accepts anything; ``fresh`` raises :class:`RunDirError` when
    ``out_dir`` holds a run; ``overwrite`` moves that run's checkpoints/, metrics.jsonl,
    config.yaml, tensorboard/ and mlperf.log (its staging tail stays, for the new run)
    into ``out_dir/previous-<timestamp>/`` and returns what it moved (None when there was
    no run).  Other files and directories (``data/``) stay.
    Call it holding the :class:`RunLock`, before the new run writes anything (its
    config.yaml included).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "resume":
        return None
    out = Path(out_dir)
    found = find_run_outputs(out)
    if not found.any:
        return None
    if mode == "fresh":
        raise RunDirError(f"output.dir '{out}' already holds a run ({found.describe()}); "
                          f"continue it with --resume, start over with --overwrite, or "
                          f"choose another output.dir")
    return _move_aside(out, time.time() if now is None else now)


def _move_aside(out: Path, now: float) -> MovedAside:
    dest = new_previous_dir(out, now)
    moved = []
    for name in RUN_OUTPUTS:
        source = out / name
        if source.exists() or source.is_symlink():
            os.rename(source, dest / name)
            moved.append(name + "/" if (dest / name).is_dir() else name)
    if _move_mlperf_log(out, dest):
        moved.append(MLPERF_LOG)
    fsync_path(dest)
    fsync_path(out)
    return MovedAside(dest, tuple(moved))


def _move_mlperf_log(out: Path, dest: Path) -> bool:
    """Move the previous run's mlperf.log aside whole; the staging lines at its end, what
    ``cosmotrain preload`` wrote for the run about to start, stay in out/ for it (before,
    the new run cut the file down to them and the previous run's log was lost)."""
    log = out / MLPERF_LOG
    if not log.is_file():
        return False
    tail = staging_tail(log.read_text(encoding="utf-8", errors="replace"))
    os.rename(log, dest / MLPERF_LOG)
    if tail:
        write_text_atomically(log, tail)
    return True


def new_previous_dir(out: Path, now: float, option: str = "output.dir") -> Path:
    """Create ``previous-<YYYYmmdd-HHMMSS>`` in ``out`` (``-2``, ``-3``... when it
    exists); ``option`` names ``out`` in the error when it cannot."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    for n in range(1, 1000):
        dest = out / (f"previous-{stamp}" + (f"-{n}" if n > 1 else ""))
        try:
            dest.mkdir()
            return dest
        except FileExistsError:
            continue
    raise RunDirError(f"{option} '{out}': too many previous-{stamp}* directories; "
                      f"clean up or choose another {option}")
