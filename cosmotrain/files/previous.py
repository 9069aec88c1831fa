"""What is replaced is kept: ``previous-<time>`` names, and one refusal of an existing output.

Every command that writes a named output (a run directory, predictions, an export, a
study, a calibration, ``plan --apply``) refuses one that exists unless asked, and what it
replaces is moved aside under a ``previous-<YYYYmmdd-HHMMSS>`` name, never deleted
(docs/RELIABILITY.md).  The names and the refusal live here so that every command words
them alike.
"""

from __future__ import annotations

import time
from pathlib import Path

from cosmotrain.errors import UserError


def previous_name(path: Path, now: float | None = None) -> Path:
    """A free name beside ``path`` to keep what is about to replace it (a file or a whole
    directory): ``<stem>.previous-<YYYYmmdd-HHMMSS><suffix>`` (``-2``, ``-3``... when
    taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None
                                                          else now))
    for n in range(1, 1000):
        kept = path.with_name(f"{path.stem}.previous-{stamp}{f'-{n}' if n > 1 else ''}"
                              f"{path.suffix}")
        if not kept.exists():
            return kept
    raise UserError(f"'{path}': too many earlier copies beside it; clean them up")


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
    raise UserError(f"{option} '{out}': too many previous-{stamp}* directories; "
                      f"clean up or choose another {option}")


def refuse_existing_file(out: Path, overwrite: bool, example: str) -> None:
    """The one refusal of an output file: a directory is named with ``example`` (a file
    name to put in it, e.g. ``"an HDF5 file such as <dir>/predictions.h5"``), and an
    existing file unless ``overwrite``."""
    if out.is_dir():
        raise UserError(f"--out '{out}' is a directory; name {example}")
    if out.exists() and not overwrite:
        raise UserError(f"--out '{out}' already exists; pass --overwrite to replace it, or "
                        f"choose another file")
