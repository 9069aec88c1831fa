"""What a damaged sample file can raise, turned into the one data error that names it.

A sample file's bytes come from outside: a header damaged anywhere makes the libraries
that parse it raise whatever their own parsers raise (h5py: ``RuntimeError`` on a metadata
checksum failure, ``TypeError`` for a datatype numpy has no equivalent for; numpy's
``.npy`` header parser: ``SyntaxError`` or ``tokenize.TokenError`` from its literal
evaluation; gzip: ``EOFError`` or ``zlib.error``).  Each format module wraps its reads in
:func:`named_on_failure` once, with the exceptions its library can raise, so that every
one of them, met by any reader or command on any rank, is the one-line
:class:`~cosmotrain.errors.DataError` naming the file (exit 2), never a traceback.
"""

from __future__ import annotations

import tokenize
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cosmotrain.errors import DataError

#: What h5py raises on a damaged file (its own errors subclass these).
HDF5_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, KeyError, RuntimeError,
                                             TypeError)
#: What numpy's ``.npy`` header parser raises on damaged header bytes.
NPY_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, SyntaxError,
                                            tokenize.TokenError, EOFError)
#: What inflating a gzip stream raises on a damaged or truncated one.
GZIP_ERRORS: tuple[type[Exception], ...] = (OSError, EOFError, zlib.error)


@contextmanager
def named_on_failure(path: Path | str, errors: tuple[type[Exception], ...], hint: str,
                     problem: str = "") -> Iterator[None]:
    """Turn ``errors`` raised inside the block into a :class:`DataError` naming ``path``.

    ``problem`` prefixes the library's own message (``"is not a readable .npy file"``);
    a :class:`DataError` raised inside passes unchanged.
    """
    try:
        yield
    except DataError:
        raise
    except errors as err:
        raise DataError(path, describe(err, problem), hint) from err


def describe(err: BaseException, problem: str = "") -> str:
    """The library's message, with the exception's kind where the message alone would not
    say what went wrong (a bare tokenizer tuple, an empty message)."""
    text = str(err)
    if not isinstance(err, (OSError, ValueError, KeyError, RuntimeError)) or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return f"{problem}: {text}" if problem else text
