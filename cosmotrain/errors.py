"""User-facing errors.

A :class:`UserError` is bad input (a config key, a data file, an argument, a rank count)
that the user can fix.  The CLI prints its one-line message and exits with code 2, without
a traceback.  Anything else is a bug and is allowed to propagate (and, under MPI, to abort
the job).
"""

from __future__ import annotations

EXIT_USER_ERROR = 2
#: A rank made no progress for the watchdog's timeout: the job was ended (MPI_Abort with this
#: code; MPICH's mpiexec then exits 4 too), see :mod:`cosmotrain.comm.watchdog`.
EXIT_WATCHDOG = 4
#: 128 + SIGINT, as a shell reports a process ended by Ctrl-C: a second Ctrl-C's exit.
EXIT_KEYBOARD = 130


class JobStopped(BaseException):
    """A stop signal that ends the command at once, on every rank: one met during start-up,
    before the training loop can take it at a step boundary (exit 75, requeued), or a
    second Ctrl-C (exit 130).  ``str(err)`` is the one line to print.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on its
    way keeps it from the CLI (nor Typer, which turns a ``KeyboardInterrupt`` into a plain
    exit and left rank 0 in ``MPI_Finalize`` while the others waited in a collective): the
    CLI prints the line and aborts the whole MPI job.  Raised from a signal handler, it
    unwinds like any exception, so an atomic write in flight removes its temporary file
    and leaves the file as before.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class UserError(Exception):
    """Bad input that the user can fix; ``str(err)`` is the one-line message.

    ``collective`` says whether every rank raises the same error (validation of the config
    or of arguments): then rank 0 prints it and all ranks exit 2.  A rank-local error (one
    rank found a corrupt file) prints on that rank and aborts the whole job.
    """

    collective: bool = True


class ConfigError(UserError):
    """An invalid configuration value; the message names the dotted key path."""

    def __init__(self, key: str, problem: str, fix: str = "") -> None:
        self.key = key
        message = f"config key '{key}': {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(message)


class DataError(UserError):
    """A missing, unreadable or malformed input file; the message names the file.

    ``kind`` says what the file is (``data file``, ``checkpoint``, ``machine file``,
    ``metrics file``...), so a damaged checkpoint is not called a data file.  Usually found
    by one rank only, so it is rank-local: the job is aborted with code 2.
    """

    collective = False

    def __init__(self, path: object, problem: str, fix: str = "", *,
                 kind: str = "data file") -> None:
        self.path = str(path)
        message = f"{kind} '{path}': {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(message)


class WriteError(UserError):
    """An output that cannot be written: no space, quota, read-only filesystem, permission.

    The message names the file or directory, the operating system's reason and a fix, e.g.
    ``cannot write 'runs/x/metrics.jsonl': No space left on device; free space or choose
    another output.dir``.  ``where`` is the setting or option that chose the location.
    Usually met by the one rank that writes, so it is rank-local unless ``collective``.
    """

    collective = False

    def __init__(self, path: object, cause: OSError | str, where: str = "output.dir",
                 collective: bool = False) -> None:
        self.path = str(path)
        self.errno = cause.errno if isinstance(cause, OSError) else None
        self.reason = _os_reason(cause) if isinstance(cause, OSError) else str(cause)
        self.where = where
        self.collective = collective
        super().__init__(f"cannot write '{path}': {self.reason}; "
                         f"{_write_fix(self.errno, where)}")


def _os_reason(err: OSError) -> str:
    """``No space left on device`` rather than ``[Errno 28] ... : 'path'``."""
    if err.strerror:
        return err.strerror
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _write_fix(code: int | None, where: str) -> str:
    import errno

    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"free space or choose another {where}"
    if code == errno.EROFS:
        return f"the filesystem is read-only: choose another {where}"
    if code in (errno.EACCES, errno.EPERM):
        return f"check its permissions or choose another {where}"
    if code == errno.ENOTDIR:
        return f"a part of the path is a file, not a directory: choose another {where}"
    if code == errno.ENAMETOOLONG:
        return f"a name in it is too long for the filesystem: choose a shorter {where}"
    return f"check the disk or choose another {where}"
