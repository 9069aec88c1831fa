"""Files that appear whole or not at all, and clear errors when the disk says no.

Every output file goes through :func:`write_atomically`: fill ``<name>.tmp`` in the same
directory, fsync it, rename it over ``<name>``, fsync the directory.  A crash at any point
leaves the previous file (if any) untouched and at worst a ``.tmp`` leftover; readers never
see a half-written file.  A failure the disk reports (``ENOSPC``, ``EDQUOT``, ``EROFS``,
``EACCES``, ``EIO``...) removes the temporary file and raises
:class:`~cosmotrain.errors.WriteError`, a one-line user error (exit 2) naming the file.

``<name>.tmp`` suits a file that one process writes.  Where several processes may write
the same file at once (the leaders of the nodes staging onto one shared directory, two
jobs caching one dataset's manifest), ``unique=True`` takes a hidden temporary name no
other process can pick, ``.<name>.<pid>.<random>.tmp``: each writer renames its own
complete file, and the last rename wins.

HDF5 files are built in memory (:func:`hdf5_image`) and written here with plain
``os.write``: HDF5's own writes on a full disk can crash the process (h5py 3.x segfaulted in
``flush`` when a small file hit ``ENOSPC``), while ``os.write`` always reports an
``OSError``.  :func:`check_writable` lets a command find an unusable output directory before
it spends any time computing.
"""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cosmotrain.errors import WriteError

TMP_SUFFIX = ".tmp"
FILE_MODE = 0o644  # before the umask, as ``open(..., "w")`` would create it
PROBE_NAME = ".cosmotrain-write-probe"
_MAX_WRITE = 1 << 30  # bytes per os.write call (Linux caps one call at ~2 GiB)
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}


def write_atomically(final: Path, write: Callable[[Path], None],
                     where: str = "output.dir", *, unique: bool = False) -> Path:
    """Call ``write(tmp)`` to fill a temporary file, then rename it to ``final``.

    An ``OSError`` from ``write``, the fsync or the rename becomes a :class:`WriteError`
    naming ``final`` (``where`` names the setting to change in its fix); any other exception
    propagates unchanged.  Either way the temporary file is gone and ``final`` is as before.
    ``unique`` picks a temporary name of this call's own (see :func:`temporary_path`).
    """
    final = Path(final)
    tmp = temporary_path(final, unique)
    try:
        write(tmp)
        _fsync_file(tmp)
        os.replace(tmp, final)
    except OSError as err:
        _remove(tmp)
        raise WriteError(final, err, where) from None
    except BaseException:
        _remove(tmp)
        raise
    try:
        fsync_path(final.parent)
    except OSError as err:
        raise WriteError(final.parent, err, where) from None
    return final


def temporary_path(final: Path, unique: bool = False) -> Path:
    """Where :func:`write_atomically` fills ``final``: ``<name>.tmp`` beside it, or with
    ``unique`` a hidden name of this call's own, ``.<name>.<pid>.<8 hex digits>.tmp`` (the
    random part tells apart processes with the same pid on two nodes)."""
    final = Path(final)
    if unique:
        return final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}"
                               f"{TMP_SUFFIX}")
    return final.with_name(final.name + TMP_SUFFIX)


_UNIQUE_TMP = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + "$")


def remove_leftovers(folder: Path, before: float) -> int:
    """Remove the hidden temporaries of :func:`temporary_path` (``unique``) under
    ``folder`` last modified before ``before`` (a time): what a killed writer left.  A
    writer still filling its temporary keeps touching it, so a caller passes a time
    before its own start and some margin.  Returns how many went; one listing per
    directory, however many files it holds."""
    removed = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            path = Path(parent) / name
            try:
                if _UNIQUE_TMP.match(name) and path.lstat().st_mtime < before:
                    path.unlink()
                    removed += 1
            except OSError:
                continue  # gone already (another node's sweep), or not ours to remove
    return removed


def write_bytes_atomically(final: Path, data: bytes | bytearray | memoryview,
                           where: str = "output.dir", mode: int = FILE_MODE, *,
                           unique: bool = False) -> Path:
    """Write ``data`` as the whole of ``final`` (atomically; mode ``mode`` less the umask)."""
    def write(tmp: Path) -> None:
        _remove(tmp)  # a crashed run's leftover keeps its old mode under O_TRUNC
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
    return write_atomically(final, write, where, unique=unique)


def write_text_atomically(final: Path, text: str, where: str = "output.dir",
                          mode: int = FILE_MODE, *, unique: bool = False) -> Path:
    """Write ``text`` (UTF-8) as the whole of ``final``, atomically."""
    return write_bytes_atomically(final, text.encode("utf-8"), where, mode, unique=unique)


def write_hdf5_atomically(final: Path, fill: Callable[[Any], None],
                          where: str = "output.dir", *, unique: bool = False) -> Path:
    """Build an HDF5 file in memory with ``fill(h5py.File)``, then write it atomically.

    ``fill`` runs before anything touches the disk: its errors (a bad value) leave no file
    at all.
    """
    return write_bytes_atomically(final, hdf5_image(fill), where, unique=unique)


def hdf5_image(fill: Callable[[Any], None]) -> memoryview:
    """The bytes of a new HDF5 file that ``fill(h5py.File)`` populates, built in memory.

    h5py writes the file into an ``io.BytesIO`` (its file-object driver): nothing touches
    the disk, so a full disk can only be met later by :func:`write_bytes_atomically`, as a
    Python ``OSError``.  The image is the buffer itself (no copy): the file costs its size
    in host memory while it is written.  It is cheaper than HDF5's ``core`` driver, whose
    ``get_file_image`` copies the whole file once more (3 x 9.4 M float32 arrays, 108 MiB:
    78-84 against 167-171 ms to build, best of 5, dev-2core, 2026-11-23).
    """
    import h5py

    buffer = io.BytesIO()
    with h5py.File(buffer, "w", track_order=True) as f:
        fill(f)
    return buffer.getbuffer()


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``os.write`` until every byte is out: a short write is retried, so a full disk shows
    as the ``OSError`` of the next call rather than a silently shorter file."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:done + _MAX_WRITE])


def check_writable(directory: str | Path, where: str = "output.dir") -> Path:
    """Make sure files can be created in ``directory`` before any work is done.

    Creates the directory (and parents) if needed, then creates, writes, fsyncs and removes
    a small probe file.  Raises :class:`WriteError` naming the directory and the cause (a
    read-only filesystem, no space, no permission, a file in the way).
    """
    folder = Path(directory)
    probe = folder / f"{PROBE_NAME}-{os.getpid()}{TMP_SUFFIX}"
    try:
        if folder.exists() and not folder.is_dir():  # exists() raises ENAMETOOLONG
            raise WriteError(folder, "it is a file, not a directory", where)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            write_all(fd, b"cosmotrain write probe\n" * 16)
            os.fsync(fd)
        finally:
            os.close(fd)
            _remove(probe)
    except OSError as err:
        raise WriteError(folder, err, where) from None
    return folder


def fsync_path(path: Path) -> None:
    """Flush a directory's entries (or a file's data) to disk before relying on them.

    Platforms or filesystems that cannot open or fsync a directory are tolerated (the
    rename still holds); a real I/O error is raised as ``OSError``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # directories cannot be opened on some platforms
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    """fsync a file just written: delayed allocation can report ENOSPC or EIO only here."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Best-effort removal of a temporary file (the original error is the one to report)."""
    try:
        os.unlink(path)
    except OSError:
        pass
