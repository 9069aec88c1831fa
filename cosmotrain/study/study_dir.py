"""An earlier study in ``scale-study --out`` is never written over: refused, or moved aside.

A study's measurements (``results.json`` and its tables, plots, and the point runs in
``points/``) took a cluster allocation to make.  Run again into the same directory, each
point's ``cosmotrain train`` would refuse the run directory it finds there, and the new
results files, all points skipped, would replace the old ones.  So a study first looks
for an earlier one: without ``--overwrite`` or ``--resume`` it stops (exit 2) before
anything runs; with ``--overwrite``, the earlier study's entries move into
``previous-<timestamp>/`` (never deleted); with ``--resume`` (a study stopped by its
allocation's end), the points it measured are kept and only the others run, provided it
measured the same config, batch and steps.  The generated dataset (``data/``,
``datagen/``) stays: the new study reuses it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cosmotrain.atomic import fsync_path, previous_name
from cosmotrain.errors import UserError, WriteError
from cosmotrain.study.points import Point
from cosmotrain.study.report import RESULTS_CSV, RESULTS_JSON, RESULTS_MD, load_results
from cosmotrain.train.run_outputs import new_previous_dir

POINTS_DIR = "points"
#: what marks a directory as holding a study (the results are written after each point)
STUDY_MARKS = (RESULTS_JSON, POINTS_DIR)
#: a study's entries, moved aside together; plots are the ``*.png`` files beside them
STUDY_ENTRIES = (RESULTS_JSON, RESULTS_CSV, RESULTS_MD, POINTS_DIR)
#: what a resumed study must share with the one it continues
RESUME_KEYS = ("config", "overrides", "model", "width", "mode", "base_batch", "steps",
               "warmup", "launcher", "ranks_per_node", "data")


def earlier_study(out: Path) -> list[str]:
    """The entries of an earlier study in ``out`` (empty when it holds none)."""
    if not any((out / mark).exists() for mark in STUDY_MARKS):
        return []
    plots = sorted(p.name for p in out.glob("*.png"))
    return [name for name in STUDY_ENTRIES if (out / name).exists()] + plots


def claim_study_dir(out: Path, overwrite: bool, now: float | None = None,
                    resume: bool = False) -> str | None:
    """Make ``out`` ready for a new study: a line saying where an earlier one went (with
    ``overwrite``), None when there was none or it is resumed; a :class:`UserError`
    without ``overwrite`` or ``resume``."""
    found = earlier_study(out)
    if not found or resume:
        return None
    if not overwrite:
        raise UserError(f"--out '{out}' holds an earlier study ({', '.join(found)}); pass "
                        f"--resume to measure only the points it lacks, --overwrite to move "
                        f"it into {out}/previous-<time>/ and measure afresh, or choose "
                        f"another --out")
    dest = new_previous_dir(out, time.time() if now is None else now, option="--out")
    for name in found:
        os.rename(out / name, dest / name)
    fsync_path(dest)
    fsync_path(out)
    return f"scale-study: moved the earlier study ({', '.join(found)}) to {dest}"


def measured_before(out: Path, current: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """For ``--resume``: the measured points of the study in ``out``, by name ({} when
    there is none).  The study must have measured what ``current`` (the new results'
    header) measures: a :class:`UserError` naming the settings that differ."""
    if not (out / RESULTS_JSON).is_file():
        return {}
    doc = load_results(out)
    differ = [key for key in RESUME_KEYS if doc.get(key) != current.get(key)]
    if differ:
        was = ", ".join(f"{key} {doc.get(key)!r}" for key in differ)
        now = ", ".join(f"{key} {current.get(key)!r}" for key in differ)
        raise UserError(f"--resume: the study in --out '{out}' measured with {was}, this "
                        f"one asks for {now}; resume it with its settings, or pass "
                        f"--overwrite to measure afresh")
    return {p["name"]: p for p in doc["points"]
            if p.get("status") == "ok" and p.get("measured")}


def adopt_measured(points: list[Point], before: Mapping[str, Mapping[str, Any]]) -> int:
    """Give every pending point measured before its earlier measurement (not run again);
    how many."""
    adopted = 0
    for point in points:
        old = before.get(point.name)
        if point.status != "pending" or old is None:
            continue
        point.status, point.measured = "ok", dict(old["measured"])
        point.command, point.output_dir = list(old.get("command", [])), old.get("output_dir", "")
        point.exit_code, point.stderr_tail = old.get("exit_code"), old.get("stderr_tail", "")
        adopted += 1
    return adopted


def set_aside_point_dir(point_dir: Path, now: float | None = None) -> Path | None:
    """Move the directory of a point about to run, if an earlier attempt left one (an
    interrupted study resumed), to ``<name>.previous-<time>`` beside it; where it went."""
    if not point_dir.exists():
        return None
    dest = previous_name(point_dir, now)
    try:
        os.rename(point_dir, dest)
    except OSError as err:  # nothing moved: one line
        raise WriteError(dest, err, where="--out") from err
    return dest
