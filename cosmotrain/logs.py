"""Log lines of a job: stdlib ``logging``, tagged with the rank and host, quiet by default.

Under ``mpiexec`` every rank writes to the same stderr, so a debug line is useless unless
it says where it came from: each line reads ``[rank 3 nid0042] cosmotrain.data.readers.job_readers: ...``.
The console (progress, results) stays rank 0's on stdout; log lines go to stderr.

By default only warnings and errors are shown.  ``--log-level LEVEL`` lowers rank 0's
threshold and leaves the other ranks at warnings (P copies of one info line help nobody);
``-v`` shows debug lines from every rank, which is what tracking a per-rank problem needs.

A leaf like ``console``: the CLI configures it once (:func:`setup_logging`), library
modules just ``logging.getLogger(__name__)``.  The rank is looked up when a line is written,
from mpi4py once MPI runs (a log line never starts MPI), so setting up logging costs
nothing for a command that never starts MPI.
"""

from __future__ import annotations

import logging
import socket
import sys
from dataclasses import dataclass
from typing import TextIO

LOGGER = "cosmotrain"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
FORMAT = "[rank %(rank)s %(host)s] %(name)s: %(message)s"


@dataclass
class _Settings:
    level: int = logging.WARNING  # rank 0's threshold (and every rank's when every_rank)
    every_rank: bool = False
    rank: int | None = None  # fixed by the caller, else asked of MPI per line


_SETTINGS = _Settings()


class _RankTag(logging.Filter):
    """Adds ``rank`` and ``host`` to a record and drops other ranks' lines below WARNING
    unless every rank was asked for."""

    host = socket.gethostname().split(".")[0]

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _SETTINGS.rank if _SETTINGS.rank is not None else mpi_rank()
        record.rank = "?" if rank is None else rank
        record.host = self.host
        if rank not in (None, 0) and not _SETTINGS.every_rank:
            return record.levelno >= logging.WARNING
        return True


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is now (a test's capture, a redirect)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def mpi_rank() -> int | None:
    """This process's rank in ``MPI_COMM_WORLD`` once MPI is running, else None.

    Looks mpi4py up in ``sys.modules`` instead of importing it: importing ``mpi4py.MPI``
    initialises MPI, which a log line must never do."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return int(mpi.COMM_WORLD.Get_rank())


def parse_level(name: str) -> int:
    """``debug``, ``info``, ``warning`` or ``error`` (any case) -> the logging level;
    ValueError for anything else (the CLI turns it into a one-line error)."""
    level = LEVELS.get(name.strip().lower())
    if level is None:
        raise ValueError(f"unknown log level {name!r}: choose one of {', '.join(LEVELS)}")
    return level


def setup_logging(level: int = logging.WARNING, *, every_rank: bool = False,
                  rank: int | None = None) -> None:
    """Send ``cosmotrain.*`` log lines of ``level`` and above to stderr, rank-tagged.

    Rank 0 (and a process whose rank is not yet known) logs at ``level``; other ranks at
    WARNING and above unless ``every_rank``.  ``rank`` fixes the tag (tests, a library
    caller without MPI); None asks MPI.  Calling it again replaces the previous set-up.
    """
    _SETTINGS.level, _SETTINGS.every_rank, _SETTINGS.rank = level, every_rank, rank
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _Stderr)]:
        logger.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RankTag())
    logger.addHandler(handler)
    logger.setLevel(level)
