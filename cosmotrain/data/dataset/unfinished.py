"""A dataset directory that a writer started but did not finish is refused, never read.

``cosmotrain preload`` records its source in ``.cosmotrain-stage.json`` before the first
copy and ``cosmotrain convert`` its source in ``.cosmotrain-convert.json`` before the
first file; both write ``manifest.json`` last, once every file is written and verified.
A directory holding such a record but no manifest is therefore a stage or a conversion
that is still running, or that ended early (a full disk, a killed rank or mpiexec): the
files there are some of the dataset's, and a scan would train on them silently.  Every
opener (``train``, ``predict``, ``preload``, ``convert``) refuses it with one line that
says how to complete it: a rerun of the same ``preload`` or ``convert`` completes it.
(``cosmotrain datagen`` itself refuses sample files without a manifest; a directory
without a writer's record, e.g. a download, is scanned.)
"""

from __future__ import annotations

import json
from pathlib import Path

from cosmotrain.errors import DataError

STAGE_RECORD = ".cosmotrain-stage.json"
CONVERT_RECORD = ".cosmotrain-convert.json"
MANIFEST_NAME = "manifest.json"
WRITERS = {STAGE_RECORD: ("staging", "cosmotrain preload again with --dest {root}"),
           CONVERT_RECORD: ("conversion", "cosmotrain convert again with --out {root}")}


def recorded(root: Path, record: str) -> str | None:
    """The source a writer's record in ``root`` names, if a readable record is there."""
    try:
        source = json.loads((root / record).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def check_finished(root: Path) -> None:
    """Refuse ``root`` (a :class:`DataError` naming it) when a stage or a conversion
    started writing it and has not written its manifest."""
    if (root / MANIFEST_NAME).exists():
        return
    for record, (what, command) in WRITERS.items():
        if (root / record).exists():
            source = recorded(root, record) or "its source"
            raise DataError(root, f"is an unfinished {what} of '{source}' ({record} is "
                            f"there but no {MANIFEST_NAME}: still being written, or "
                            f"stopped early)", f"wait for it, or run "
                            f"{command.format(root=root)} to complete it")
