"""User-facing errors.

A :class:`UserError` is bad input (a config key, a data file, an argument, a rank count)
that the user can fix.  The CLI prints its one-line message and exits with code 2, without
a traceback.  Anything else is a bug and is allowed to propagate (and, under MPI, to abort
the job).
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


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
    """A missing, unreadable or malformed data file; the message names the file.

    Usually found by one rank only, so it is rank-local: the job is aborted with code 2.
    """

    collective = False

    def __init__(self, path: object, problem: str, fix: str = "") -> None:
        self.path = str(path)
        message = f"data file '{path}': {problem}"
        if fix:
            message += f"; {fix}"
        super().__init__(message)
