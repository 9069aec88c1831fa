"""Claiming ``output.dir`` for one training run, collectively, before any work.

Rank 0 does the file-system work (the directory's other ranks may be on other nodes, and
one writer is the point): it checks that the directory is writable, takes the run lock
(:class:`~cosmotrain.files.run_lock.RunLock`) and makes sure a fresh run does not mix with
another run's outputs.  The verdict is broadcast, so a refusal is one line printed once
and every rank exits 2 before anything is read, computed or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosmotrain.comm.collective import on_root
from cosmotrain.train.run_outputs import MODES, check_fresh_directory
from cosmotrain.files.run_lock import RunLock, this_process


@dataclass
class Claim:
    """The run's hold on ``output.dir``: the lock on rank 0 (None elsewhere) and what
    rank 0 should say about it (a stale lock replaced, a previous run moved aside)."""

    out_dir: Path
    lock: RunLock | None
    notes: list[str]

    def release(self) -> None:
        """Give the lock back (rank 0); safe to call more than once."""
        if self.lock is not None:
            self.lock.release()


def claim_output_dir(out_dir: str | Path, comm: Any, mode: str,
                     job_id: str | None = None) -> Claim:
    """Lock ``out_dir`` for this run (collective).

    ``mode``: ``fresh`` refuses a directory holding another run; ``resume`` and
    ``overwrite`` accept it (the latter moves it aside with :func:`move_aside_outputs` once
    the job has been built, so a config that fails its checks moves nothing).  ``job_id`` (Slurm's) is
    recorded in the lock so a refused user knows which job holds the directory.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out = Path(out_dir)
    held: list[RunLock] = []

    def work() -> list[str]:
        from cosmotrain.files.atomic import check_writable

        check_writable(out)
        lock = RunLock(out, this_process(job_id))
        stale = lock.acquire()
        held.append(lock)
        try:
            moved = check_fresh_directory(out, "fresh" if mode == "fresh" else "resume")
        except BaseException:
            lock.release()
            raise
        return [note.note() for note in (stale, moved) if note is not None]

    notes = on_root(comm, work)
    return Claim(out, held[0] if held else None, notes)


def move_aside_outputs(claim: Claim, comm: Any) -> list[str]:
    """Keep whatever run the directory holds under ``previous-<time>/`` and start afresh
    (``--overwrite``, or ``--resume`` with no intact checkpoint); collective: rank 0
    moves, every rank gets the note."""

    def work() -> list[str]:
        moved = check_fresh_directory(claim.out_dir, "overwrite")
        return [moved.note()] if moved is not None else []

    return on_root(comm, work)
