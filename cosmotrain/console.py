"""Console output: rank 0 owns the console.

Under ``mpiexec``/``srun`` stdout is a pipe, so progress is printed as plain lines; in a
terminal it is a live Rich progress bar.  Other ranks stay silent unless they must report
an error of their own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def make_console(rank: int = 0) -> Console:
    """A console that prints on rank 0 only (``quiet`` elsewhere)."""
    return Console(quiet=rank != 0, highlight=False, soft_wrap=True)


def is_terminal() -> bool:
    return sys.stdout.isatty()


@contextmanager
def progress(total: int, description: str, rank: int = 0) -> Iterator[Callable[[int], None]]:
    """Yield ``update(done)``: a Rich bar in a terminal, about ten plain lines otherwise."""
    if rank != 0:
        yield lambda done: None
    elif is_terminal():
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn()) as bar:
            task = bar.add_task(description, total=total)
            yield lambda done: bar.update(task, completed=done)
    else:
        yield _plain_progress(total, description)


def _plain_progress(total: int, description: str) -> Callable[[int], None]:
    start = time.perf_counter()
    step = max(1, total // 10)

    def update(done: int) -> None:
        if done % step == 0 or done == total:
            elapsed = time.perf_counter() - start
            print(f"{description}: {done}/{total} ({elapsed:.1f} s)", flush=True)

    return update
