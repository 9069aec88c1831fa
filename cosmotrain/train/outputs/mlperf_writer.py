"""``<output.dir>/mlperf.log``: the file of MLPerf HPC compliance lines and its one writer.

The lines are ``:::MLLOG {json}``, made by the mlperf-logging package's ``mllog`` (an
optional extra: ``pip install -e ".[mlperf]"``), so their format is the one the package's
compliance checker parses.  Rank 0 alone writes.  Two commands write the file:

- ``cosmotrain preload`` appends ``staging_start`` / ``staging_stop`` around the copy
  (:func:`staging_logged`, called by the CLI: ``data/`` may not import ``train/``);
- ``cosmotrain train`` (``train/outputs/mlperf.py``) writes the run, from ``init_start`` to
  ``run_stop``.  A fresh run starts the file anew but keeps the staging lines at its end
  (the preload that just ran for it); a resumed run appends to what is there.

Each line goes out in one ``os.write`` on an ``O_APPEND`` descriptor, so a reader (or a
crash) never sees half of one from us; a disk that refuses it is a :class:`WriteError`
naming the file, the file cut back to its last whole line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cosmotrain
from cosmotrain.files.atomic import FILE_MODE, write_all, write_text_atomically
from cosmotrain.config.schema import Config
from cosmotrain.errors import UserError, WriteError

MLPERF_LOG = "mlperf.log"
INSTALL_HINT = 'pip install -e ".[mlperf]"'
STAGING_KEYS = ("staging_start", "staging_stop")
PREFIX = ":::MLLOG "
_SOURCE_ROOT = str(Path(cosmotrain.__file__).parents[1])  # call sites shown relative to it


def require_mllog() -> None:
    """Raise a one-line UserError when mlperf-logging is not installed.

    Called on every rank (the same environment gives the same answer), so a missing
    package stops the whole job before it starts rather than rank 0 alone."""
    if importlib.util.find_spec("mlperf_logging") is None:
        raise UserError(f"output.mlperf_log: true needs the mlperf-logging package, which "
                        f"is not installed; {INSTALL_HINT}, or set output.mlperf_log: false")


def mlperf_log_path(out_dir: str | Path) -> Path:
    return Path(out_dir) / MLPERF_LOG


class MLPerfLog:
    """Appends mllog lines to ``path`` (rank 0's writer).

    ``fresh``: keep only the staging lines at the end of an existing file (what
    ``cosmotrain preload`` wrote for this run) and drop the rest, an earlier run's log;
    otherwise append, first ending a line a crash left torn so the next one parses.
    """

    def __init__(self, path: str | Path, fresh: bool = False) -> None:
        from mlperf_logging.mllog import mllog

        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if fresh:
                _keep_staging_tail(self.path)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT,
                                           FILE_MODE)
        except OSError as err:
            raise WriteError(self.path, err) from None
        self._lines = _Lines(self._fd, self.path)
        logger = logging.Logger("cosmotrain.mlperf")  # private: not the root's, not stdout
        logger.propagate = False
        logger.addHandler(self._lines)
        # the call site shown in each line is the caller of event/start/end
        self._mllogger = mllog.MLLogger(logger=logger, default_stack_offset=3,
                                        root_dir=re.escape(_SOURCE_ROOT))  # mllog: a regex
        if self._lines.size > 0 and not _ends_with_newline(self._fd):
            try:
                self._lines.write("\n")
            except WriteError:
                self.close()
                raise

    def event(self, key: str, value: Any = None, metadata: dict | None = None,
              time_ms: int | None = None) -> None:
        """A point in time (``POINT_IN_TIME``): a setting or a result."""
        self._write(self._mllogger.event, key, value, metadata, time_ms)

    def start(self, key: str, value: Any = None, metadata: dict | None = None,
              time_ms: int | None = None) -> None:
        """The start of an interval (``INTERVAL_START``)."""
        self._write(self._mllogger.start, key, value, metadata, time_ms)

    def end(self, key: str, value: Any = None, metadata: dict | None = None,
            time_ms: int | None = None) -> None:
        """The end of an interval (``INTERVAL_END``)."""
        self._write(self._mllogger.end, key, value, metadata, time_ms)

    def _write(self, method: Any, key: str, value: Any, metadata: dict | None,
               time_ms: int | None) -> None:
        if self._fd is None:
            raise ValueError(f"MLPerf log '{self.path}' is closed")
        method(key=key, value=value, metadata=metadata, time_ms=time_ms)
        self._lines.raise_error()

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class _Lines(logging.Handler):
    """mllog's logging handler: each line in one ``os.write``; the first failure is kept
    for :meth:`raise_error` (``logging`` itself would only print a traceback)."""

    def __init__(self, fd: int, path: Path) -> None:
        super().__init__(logging.INFO)
        self.fd, self.path = fd, path
        self.size = os.fstat(fd).st_size
        self.error: Exception | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is not None:
            return
        if record.levelno != logging.INFO:  # mllog's own complaint, e.g. a value not JSON
            self.error = ValueError(f"mllog: {record.getMessage().strip()}")
            return
        try:
            self.write(record.getMessage() + "\n")
        except WriteError as err:
            self.error = err

    def write(self, text: str) -> None:
        data = text.encode("utf-8")
        try:
            write_all(self.fd, data)
        except OSError as err:
            with contextlib.suppress(OSError):  # drop the part of a line a failure left
                os.ftruncate(self.fd, self.size)
            raise WriteError(self.path, err) from None
        self.size += len(data)

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


def _ends_with_newline(fd: int) -> bool:
    return os.pread(fd, 1, os.fstat(fd).st_size - 1) == b"\n"


def line_key(line: str) -> str | None:
    """The key of one ``:::MLLOG`` line; None for any other or a torn one."""
    if not line.startswith(PREFIX):
        return None
    try:
        entry = json.loads(line[len(PREFIX):])
    except ValueError:
        return None
    return entry.get("key") if isinstance(entry, dict) else None


def staging_tail(text: str) -> str:
    """The trailing whole staging lines of a log's ``text`` (what ``cosmotrain preload``
    wrote for the run that comes next), or ""."""
    lines = text.split("\n")[:-1]  # what follows the last newline is torn, or empty
    keep = len(lines)
    while keep > 0 and line_key(lines[keep - 1]) in STAGING_KEYS:
        keep -= 1
    return "".join(line + "\n" for line in lines[keep:])


def _keep_staging_tail(path: Path) -> None:
    """Rewrite ``path`` with only its trailing whole staging lines (none: empty)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    tail = staging_tail(text)
    if tail != text:
        write_text_atomically(path, tail)


@contextlib.contextmanager
def staging_logged(cfg: Config, comm: Any) -> Iterator[None]:
    """``staging_start`` before the body and ``staging_stop`` after it, in the mlperf.log
    of ``cfg.output.dir`` when ``output.mlperf_log`` is on (rank 0 writes; call it on
    every rank).  A body that fails leaves the start alone: no staging took place."""
    if not cfg.output.mlperf_log:
        yield
        return
    require_mllog()
    log = MLPerfLog(mlperf_log_path(cfg.output.dir)) if comm.Get_rank() == 0 else None
    try:
        if log is not None:
            log.start("staging_start")
        yield
        if log is not None:
            log.end("staging_stop")
    finally:
        if log is not None:
            log.close()
