"""``--resume`` from the same dataset at another path: its identity, not its path, decides.

``resume_check`` refuses a changed ``data.path`` or ``data.format`` (another dataset is
another trajectory).  But a run started on the shared file system continues from the
node-local copy ``cosmotrain preload`` made of it, and a run that forced ``data.format``
to the format ``auto`` detected reads the same files.  So when those keys are all that
is refused about the data, rank 0 opens both datasets' descriptions (their
``manifest.json`` or scan cache and label tables: no volume is read) and compares their
identities (``file_sums.identity``: volume shape, dtype and layout, every split's entries
in order and their labels).  The same identity turns the refusal into an allowed change, printed with the
note; a different dataset, or a checkpoint's dataset that is no longer there to compare,
stays refused.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.comm.collective import on_root
from cosmotrain.config.schema import Config
from cosmotrain.data.dataset.manifest import dataset_identity
from cosmotrain.errors import UserError
from cosmotrain.train.checkpoints.resume_check import MISSING, ResumeDiff, Tree

DATA_KEYS = ("data.path", "data.format")


def accept_same_dataset(diff: ResumeDiff, saved: Tree, cfg: Config, comm: Any) -> None:
    """Move refused ``data.path`` / ``data.format`` changes of ``diff`` to the allowed
    ones when the checkpoint's dataset and ``cfg``'s are the same (collective)."""
    changes = [c for c in diff.refused if c.key in DATA_KEYS]
    if not changes or cfg.data.source != "files":
        return
    old = {c.key: c.old for c in changes}
    path = old.get("data.path", cfg.data.path)
    format = old.get("data.format", cfg.data.format)
    if path is MISSING or format is MISSING:
        return
    note = on_root(comm, lambda: _same(str(path), str(format), cfg))
    if note is None:
        return
    for change in changes:
        diff.refused.remove(change)
        diff.allowed.append(change)
        diff.notes[change.key] = note


def _same(path: str, format: str, cfg: Config) -> str | None:
    """Rank 0: the note when dataset ``path`` (read as ``format``) is ``cfg``'s dataset;
    None when it is another, or cannot be described any more."""
    try:
        before = dataset_identity(path, cfg.data.cache_dir, format)
        now = dataset_identity(str(cfg.data.path), cfg.data.cache_dir, cfg.data.format)
    except (UserError, OSError):
        return None  # gone or unreadable: the change stays refused
    return f"the same dataset (identity {now})" if before == now else None
