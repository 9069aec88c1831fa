"""Whose copy a stage directory holds, so that staging never writes over another dataset.

Staging replaces a file in ``--dest`` whose bytes differ from the source's file of the
same name.  That is right for a re-run over the same dataset (a damaged or outdated
copy), and wrong for a directory holding something else: the default destination,
``$TMPDIR/cosmotrain/<dataset directory name>``, is shared by two datasets whose
directories have the same name, and a job may be training from the copy there.  So each
node's leader records the source in ``<dest>/.cosmotrain-stage.json`` before the first
copy (the first record wins: two jobs staging two datasets at once cannot both pass),
and staging goes ahead only into a directory that is missing or empty, records the same
source, or (written before the record existed) holds a ``manifest.json`` listing the
same files.  ``preload --overwrite`` starts over instead: whatever ``--dest`` holds is
renamed aside whole (:func:`move_aside`), never deleted.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from cosmotrain.files.atomic import check_writable
from cosmotrain.files.previous import previous_name
from cosmotrain.data.dataset import cache
from cosmotrain.data.dataset.manifest import MANIFEST_NAME
from cosmotrain.data.dataset.unfinished import STAGE_RECORD
from cosmotrain.errors import UserError, WriteError


def stage_problem(dest: Path, source: Path, files: Mapping[str, Sequence[str]],
                  option: str = "--dest") -> str | None:
    """Why ``dest`` cannot take a staging of dataset ``source`` with ``files``; None when
    it can."""
    if not dest.exists():
        return None
    if not dest.is_dir():
        return f"{option} '{dest}' is a file; choose a directory"
    recorded = recorded_source(dest)
    if recorded == str(source.resolve()) or (recorded is None and _lists(dest, files)):
        return None
    try:
        if recorded is None and not any(dest.iterdir()):
            return None
    except OSError as err:
        return f"{option} '{dest}' cannot be listed ({err}); choose another {option}"
    return _held(dest, source, recorded, option)


def _held(dest: Path, source: Path, recorded: str | None, option: str) -> str:
    held = f"a staging of '{recorded}'" if recorded else "files that are not a staging of it"
    return (f"{option} '{dest}' holds {held}; staging '{source}' there would replace "
            f"them: choose another {option}, or remove that directory first")


def record_source(dest: Path, source: Path, option: str = "--dest") -> None:
    """Record ``source`` as what ``dest`` holds a staging of, unless a record is there:
    the first record wins (it is linked into place whole, never replaced), so a
    concurrent staging of another dataset that passed :func:`stage_problem` too is
    refused here (:class:`UserError`).  A write the disk refuses is a WriteError."""
    check_writable(dest, option)  # a file in the way, read-only: one WriteError line
    wanted = str(source.resolve())
    tmp = cache.write_json(dest / f"{STAGE_RECORD}.{os.getpid()}.{secrets.token_hex(4)}",
                           {"source": wanted}, where=option)
    record = dest / STAGE_RECORD
    try:
        os.link(tmp, record)  # fails when a record is there: it stays, compared below
    except FileExistsError:
        pass  # recorded before (this source re-staged, or a concurrent staging first)
    except OSError:  # no hard links on this file system: moved in whole, never over one
        if not record.exists():
            os.replace(tmp, record)
    finally:
        tmp.unlink(missing_ok=True)
    recorded = recorded_source(dest)
    if recorded != wanted:
        raise UserError(_held(dest, source, recorded, option))


def recorded_source(dest: Path) -> str | None:
    """The source recorded in ``dest``, if a readable record is there."""
    try:
        source = json.loads((dest / STAGE_RECORD).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def _lists(dest: Path, files: Mapping[str, Sequence[str]]) -> bool:
    """Whether ``dest`` has a ``manifest.json`` listing exactly ``files`` (a staging made
    before the record existed)."""
    try:
        splits = json.loads((dest / MANIFEST_NAME).read_text()).get("splits", {})
        return {s: list(v.get("files", [])) for s, v in splits.items()} == \
            {s: list(names) for s, names in files.items()}
    except (OSError, ValueError, AttributeError):
        return False


def move_aside(dest: Path, option: str = "--dest") -> Path | None:
    """Rename a non-empty ``dest`` to ``<dest>.previous-<time>`` beside it, so a staging
    (or a conversion: ``option`` ``--out``) starts over without deleting anything; where it went (None: nothing to move, or the
    leader of another node sharing the directory moved it first)."""
    try:
        if not dest.is_dir() or not any(dest.iterdir()):
            return None
        kept = previous_name(dest)
        os.rename(dest, kept)
        return kept
    except FileNotFoundError:
        return None  # moved by another node's leader a moment ago
    except OSError as err:
        raise WriteError(dest, err, option) from err
