"""``--resume``: find the newest intact checkpoint, check it fits this run, report.

Rank 0 looks for the newest checkpoint that loads and verifies its checksums; damaged
newer ones are renamed ``*.damaged`` (kept for inspection, out of the way of retention and
of later resumes) and reported.  Every rank then loads the chosen file and compares the
config stored in it with the current one (:mod:`cosmotrain.train.checkpoints.resume_check`):
a change to the model, the data or the global batch is refused in one line (the same
dataset at another path is the same data: :mod:`cosmotrain.train.checkpoints.resume_data`),
a change of layout,
length or schedule is allowed and printed.  Every rank reaches the same verdict from the
same file, so errors are collective and printed once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cosmotrain.comm.collective import on_root
from cosmotrain.config.load import config_to_dict
from cosmotrain.config.schema import Config
from cosmotrain.errors import WriteError
from cosmotrain.train.checkpoints.checkpoint import (CheckpointState, checkpoint_dir,
                                                      load_checkpoint, newest_intact_checkpoint)
from cosmotrain.train.checkpoints.resume_check import compare_for_resume
from cosmotrain.train.checkpoints.resume_data import accept_same_dataset

DAMAGED_SUFFIX = ".damaged"


@dataclass
class ResumePoint:
    """The checkpoint a run continues from (None: nothing intact to continue) and what
    rank 0 should say about the search and the config."""

    path: Path | None
    state: CheckpointState | None = None
    notes: list[str] = field(default_factory=list)


def find_resume_point(out_dir: str | Path, cfg: Config, comm: Any) -> ResumePoint:
    """The newest intact checkpoint of ``out_dir``, loaded on every rank and checked
    against ``cfg`` (collective); a refused config change raises one UserError."""
    loaded: list[CheckpointState] = []  # rank 0's copy: the search has read it already
    found, notes = on_root(comm, lambda: _newest_intact(checkpoint_dir(out_dir), loaded))
    if found is None:
        return ResumePoint(None, None, notes)
    path = Path(found)
    state = loaded[0] if loaded else load_checkpoint(path)
    saved = yaml.safe_load(state.config_yaml) or {}
    diff = compare_for_resume(saved, config_to_dict(cfg))
    accept_same_dataset(diff, saved, cfg, comm)  # data.path: another copy of the same data
    diff.raise_if_refused(path)
    notes += diff.allowed_lines()
    notes.append(f"cosmotrain: resuming from {path} at step {state.step} ({state.epoch} "
                 f"epoch{'' if state.epoch == 1 else 's'} complete, {state.samples_seen} "
                 f"samples seen)")
    return ResumePoint(path, state, notes)


def _newest_intact(folder: Path, loaded: list[CheckpointState]
                   ) -> tuple[str | None, list[str]]:
    """Rank 0's search: the newest intact checkpoint's path (its state appended to
    ``loaded``); damaged ones moved aside."""
    found = newest_intact_checkpoint(folder)
    if found.state is not None:
        loaded.append(found.state)
    notes = []
    for path, reason in found.skipped:
        kept = path.with_name(path.name + DAMAGED_SUFFIX)
        try:
            os.replace(path, kept)
        except OSError as err:
            raise WriteError(kept, err) from None
        notes.append(f"cosmotrain: warning: skipped damaged checkpoint {path} ({reason}); "
                     f"kept as {kept.name}")
    return (str(found.path) if found.path is not None else None), notes
