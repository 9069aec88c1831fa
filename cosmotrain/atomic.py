"""Files that appear whole or not at all: write to ``<name>.tmp``, fsync, rename over.

A crash at any point leaves the previous file (if any) untouched and at worst a ``.tmp``
leftover; readers never see a half-written file.  Checkpoints and prediction files use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TMP_SUFFIX = ".tmp"


def write_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` to fill a temporary file, then rename it to ``final``."""
    final = Path(final)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(final.parent)
    return final


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to disk before relying on it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # directories cannot be opened on some platforms; the rename still holds
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)
