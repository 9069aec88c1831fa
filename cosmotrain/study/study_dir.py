"""An earlier study in ``scale-study --out`` is never written over: refused, or moved aside.

A study's measurements (``results.json`` and its tables, plots, and the point runs in
``points/``) took a cluster allocation to make.  Run again into the same directory, each
point's ``cosmotrain train`` would refuse the run directory it finds there, and the new
results files, all points skipped, would replace the old ones.  So a study first looks
for an earlier one: without ``--overwrite`` it stops (exit 2) before anything runs; with
it, the earlier study's entries move into ``previous-<timestamp>/`` (never deleted).  The
generated dataset (``data/``, ``datagen/``) stays: the new study reuses it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cosmotrain.atomic import fsync_path
from cosmotrain.errors import UserError
from cosmotrain.study.report import RESULTS_CSV, RESULTS_JSON, RESULTS_MD
from cosmotrain.train.run_outputs import new_previous_dir

POINTS_DIR = "points"
#: what marks a directory as holding a study (the results are written after each point)
STUDY_MARKS = (RESULTS_JSON, POINTS_DIR)
#: a study's entries, moved aside together; plots are the ``*.png`` files beside them
STUDY_ENTRIES = (RESULTS_JSON, RESULTS_CSV, RESULTS_MD, POINTS_DIR)


def earlier_study(out: Path) -> list[str]:
    """The entries of an earlier study in ``out`` (empty when it holds none)."""
    if not any((out / mark).exists() for mark in STUDY_MARKS):
        return []
    plots = sorted(p.name for p in out.glob("*.png"))
    return [name for name in STUDY_ENTRIES if (out / name).exists()] + plots


def claim_study_dir(out: Path, overwrite: bool, now: float | None = None) -> str | None:
    """Make ``out`` ready for a new study: a line saying where an earlier one went (with
    ``overwrite``), None when there was none; a :class:`UserError` without ``overwrite``."""
    found = earlier_study(out)
    if not found:
        return None
    if not overwrite:
        raise UserError(f"--out '{out}' holds an earlier study ({', '.join(found)}); pass "
                        f"--overwrite to move it into {out}/previous-<time>/ and measure "
                        f"afresh, or choose another --out")
    dest = new_previous_dir(out, time.time() if now is None else now, option="--out")
    for name in found:
        os.rename(out / name, dest / name)
    fsync_path(dest)
    fsync_path(out)
    return f"scale-study: moved the earlier study ({', '.join(found)}) to {dest}"
