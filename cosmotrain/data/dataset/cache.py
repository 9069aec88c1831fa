"""Where a dataset's cached manifest and sample tables live, and atomic writes of them.

Caches go next to the data when the dataset directory is writable (they then travel with
it, e.g. when it is staged), otherwise under a per-user cache directory, in a
sub-directory named by a hash of the dataset's absolute path: ``data.cache_dir``, which
the command line fills, when the config leaves it null, from the environment
($COSMOTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/cosmotrain: ``cli/app.py``), else
``~/.cache/cosmotrain`` (a library caller that sets nothing).

Lookups try the dataset directory first, then the cache directory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cosmotrain.files.atomic import write_bytes_atomically, write_text_atomically

def default_cache_base() -> Path:
    """The per-user cache directory when ``data.cache_dir`` is not set."""
    return Path.home() / ".cache" / "cosmotrain"


def fallback_dir(root: Path, cache_dir: str | Path | None = None) -> Path:
    """The cache directory of dataset ``root`` when ``root`` itself is not writable."""
    base = Path(cache_dir) if cache_dir else default_cache_base()
    key = hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:16]
    return base / f"{Path(root).name}-{key}"


def is_writable(directory: Path) -> bool:
    """True when files can be created in ``directory`` (tries one, as root ignores modes)."""
    probe = directory / f".cosmotrain-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
        return True
    except OSError:
        return False


def find(root: Path, name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The cached file ``name`` of dataset ``root``, if one exists."""
    for directory in (Path(root), fallback_dir(root, cache_dir)):
        if (directory / name).is_file():
            return directory / name
    return None


def target(root: Path, name: str, cache_dir: str | Path | None = None) -> Path:
    """Where to write cache file ``name``: next to the data if writable, else the cache dir."""
    directory = Path(root) if is_writable(Path(root)) else fallback_dir(root, cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def write_json(path: Path, data: Mapping[str, Any], where: str = "data.cache_dir") -> Path:
    """Write ``data`` as JSON atomically, through a temporary file of this process's own:
    two jobs (or two nodes' leaders) may cache the same file at once.  A write the disk
    refuses is a :class:`~cosmotrain.errors.WriteError` naming ``path``."""
    return write_text_atomically(path, json.dumps(data, indent=2) + "\n", where, unique=True)


def write_npz(path: Path, arrays: Mapping[str, np.ndarray],
              where: str = "data.cache_dir") -> Path:
    """Write ``arrays`` as an .npz atomically (built in memory; as :func:`write_json`)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return write_bytes_atomically(path, buffer.getbuffer(), where, unique=True)


def files_key(files: list[str] | tuple[str, ...]) -> str:
    """A fingerprint of a split's file list: a cached table is valid for this list only."""
    return hashlib.sha1("\n".join(files).encode()).hexdigest()


def file_stat(path: Path) -> tuple[int, int]:
    """``(size, mtime in ns)`` of ``path``, the key a cached entry about it is valid for;
    ``(-1, -1)`` when it cannot be stat-ed (missing: whatever reads it names the fault)."""
    try:
        status = os.stat(path)
    except OSError:
        return -1, -1
    return status.st_size, status.st_mtime_ns
