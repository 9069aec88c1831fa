"""Run-directory safety: one writer per ``output.dir`` at a time.

:class:`RunLock` is a lock file ``<output.dir>/.cosmotrain.lock`` that names its holder
(host, pid, start time, command line, Slurm job id).  It is created atomically
(``O_CREAT | O_EXCL``); a second job on the same directory is refused with a line naming
the holder.  A lock left by a process that is gone (same host, and the pid is not running
or now belongs to another process, told apart by its start time in ``/proc/<pid>/stat``)
is stale: it is replaced, and ``acquire`` says so.  A lock from another host cannot be
checked and is refused with the command that removes it.

Whether the directory holds another run is :mod:`cosmotrain.train.run_outputs`'s.

Pure building blocks: no MPI, no printing, no environment reads.  The caller (rank 0)
passes who it is (:func:`this_process`) and prints the notes returned.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cosmotrain.files.atomic import fsync_path, write_all, write_text_atomically
from cosmotrain.errors import UserError, WriteError

LOCK_NAME = ".cosmotrain.lock"
LOCK_FORMAT = "cosmotrain-lock"
#: held (O_EXCL) while a stale lock is being replaced, so two takers cannot both win
TAKEOVER_SUFFIX = ".takeover"
#: a takeover guard older than this was left by a crash mid-takeover and is removed
TAKEOVER_EXPIRY_S = 30.0
#: how long a lock file that is still being written (empty or partial JSON) is waited for
READ_PATIENCE_S = 2.0



class RunDirError(UserError):
    """``output.dir`` is in use or holds another run.  Found by the rank that checks
    (rank 0): broadcast the outcome to raise it collectively."""


# --------------------------------------------------------------------------- the holder


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or wants) a run lock: the contents of the lock file."""

    host: str
    pid: int
    started: float  # epoch seconds
    argv: tuple[str, ...] = ()
    job_id: str | None = None
    proc_start: int | None = None  # /proc/<pid>/stat start time (clock ticks since boot)
    token: str = ""  # tells two holders with the same host and pid apart

    def to_json(self) -> str:
        record = {"format": LOCK_FORMAT, "host": self.host, "pid": self.pid,
                  "started": _iso(self.started), "started_epoch": self.started,
                  "command": shlex.join(self.argv), "argv": list(self.argv),
                  "job_id": self.job_id, "proc_start": self.proc_start,
                  "token": self.token}
        return json.dumps(record, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LockHolder:
        """Parse a lock file; ValueError when it is not one (empty, partial, foreign)."""
        record = json.loads(text)
        if not isinstance(record, dict) or record.get("format") != LOCK_FORMAT:
            raise ValueError("not a cosmotrain lock")
        try:
            return cls(host=str(record["host"]), pid=int(record["pid"]),
                       started=float(record["started_epoch"]),
                       argv=tuple(str(a) for a in record.get("argv") or ()),
                       job_id=_optional_str(record.get("job_id")),
                       proc_start=_optional_int(record.get("proc_start")),
                       token=str(record.get("token") or ""))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed lock: {err}") from None

    def describe(self) -> str:
        """``pid 1234 on host h (Slurm job 77) since 2026-11-23 15:02``."""
        job = f" (Slurm job {self.job_id})" if self.job_id else ""
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}{job} since {since}"


def this_process(job_id: str | None = None, argv: Sequence[str] | None = None
                 ) -> LockHolder:
    """The calling process as a lock holder (the CLI passes ``$SLURM_JOB_ID``)."""
    pid = os.getpid()
    return LockHolder(host=socket.gethostname(), pid=pid, started=time.time(),
                      argv=tuple(sys.argv if argv is None else argv),
                      job_id=job_id or None, proc_start=LocalProcesses().start_time(pid))


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(epoch))


def _optional_str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ---------------------------------------------------------------- is the holder alive?


class ProcessProbe(Protocol):
    """What this host can tell about a pid (faked in tests)."""

    def alive(self, pid: int) -> bool: ...

    def start_time(self, pid: int) -> int | None: ...


class LocalProcesses:
    """This host's processes: ``kill(pid, 0)`` and ``/proc/<pid>/stat``."""

    def alive(self, pid: int) -> bool:
        """Whether ``pid`` runs; a zombie (exited, not yet reaped: an aborted MPI rank
        for a moment after mpiexec returns) holds nothing and counts as gone."""
        if pid <= 0:  # kill(0 or -n) would address process groups, never a lock holder
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by another user
            return True
        return _stat_fields(pid)[:1] != ["Z"]

    def start_time(self, pid: int) -> int | None:
        """Field 22 of ``/proc/<pid>/stat`` (after the parenthesised name), else None."""
        try:
            return int(_stat_fields(pid)[19])
        except (IndexError, ValueError):
            return None


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` from field 3 (the state) on; empty where there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return text[text.rfind(")") + 2:].split()


@dataclass(frozen=True)
class StaleLock:
    """A lock whose holder is gone, replaced by :meth:`RunLock.acquire`."""

    path: Path
    holder: LockHolder
    reason: str

    def note(self) -> str:
        """One line for the console."""
        return (f"cosmotrain: replaced the stale lock {self.path} of {self.holder.describe()} "
                f"({self.reason})")


# ---------------------------------------------------------------------------- the lock


@dataclass
class RunLock:
    """``<out_dir>/.cosmotrain.lock``: at most one run writes into ``out_dir`` at a time.

    ``holder`` is this process (:func:`this_process`); ``probe`` answers for the pids of
    this host.  Use as a context manager, or :meth:`acquire` then :meth:`release`.
    """

    out_dir: Path
    holder: LockHolder
    probe: ProcessProbe = field(default_factory=LocalProcesses)
    held: bool = field(default=False, init=False)
    #: the stale lock the last acquire replaced (for ``with RunLock(...) as lock:`` users)
    replaced: StaleLock | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if not self.holder.token:
            self.holder = _with_token(self.holder)

    @property
    def path(self) -> Path:
        return self.out_dir / LOCK_NAME

    def acquire(self) -> StaleLock | None:
        """Take the lock; returns the stale lock it replaced, if any.

        Raises :class:`RunDirError` naming the holder when another live (or uncheckable)
        run holds it.
        """
        if self.held:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"output.dir '{self.out_dir}' cannot be created "
                              f"({err.strerror or err}); choose a writable output.dir") from None
        for _ in range(10):  # each retry follows another process's move: few are needed
            if self._create():
                self.held, self.replaced = True, None
                return None
            text, other = self._read()
            if text is None:
                continue  # released meanwhile: try again
            if other is None:
                raise RunDirError(self._unreadable_message())
            reason = self._stale_reason(other)
            if reason is None:
                raise RunDirError(self._busy_message(other))
            if self._take_over(text):
                self.held, self.replaced = True, StaleLock(self.path, other, reason)
                return self.replaced
        raise RunDirError(f"output.dir '{self.out_dir}': could not take the lock "
                          f"{LOCK_NAME}, other jobs keep changing it; choose another "
                          f"output.dir")

    def release(self) -> bool:
        """Remove the lock if it is still ours; True when it was removed."""
        if not self.held:
            return False
        self.held = False
        _, current = self._read(patience=0.0)
        if current is None or current.token != self.holder.token:
            return False  # replaced by someone who judged us dead: theirs now
        self.path.unlink(missing_ok=True)
        return True

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ internals

    def _create(self) -> bool:
        """Create the lock exclusively, written and fsynced; False when it exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except PermissionError:
            raise RunDirError(f"output.dir '{self.out_dir}' is not writable (cannot create "
                              f"{LOCK_NAME}); choose a writable output.dir") from None
        try:
            write_all(fd, self.holder.to_json().encode())
            os.fsync(fd)
        except BaseException as err:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if isinstance(err, OSError):
                raise WriteError(self.path, err) from None
            raise
        os.close(fd)
        try:
            fsync_path(self.out_dir)
        except OSError as err:
            raise WriteError(self.out_dir, err) from None
        return True

    def _read(self, patience: float | None = None
              ) -> tuple[str | None, LockHolder | None]:
        """The lock's text and holder; holder None while it stays unparsable.

        A lock just created by another process may be empty for a moment, so an
        unparsable lock is read again for up to ``patience`` seconds (READ_PATIENCE_S).
        """
        wait = READ_PATIENCE_S if patience is None else patience
        deadline = time.monotonic() + wait
        while True:
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return None, None
            try:
                return text, LockHolder.from_json(text)
            except ValueError:
                if time.monotonic() >= deadline:
                    return text, None
                time.sleep(0.05)

    def _stale_reason(self, other: LockHolder) -> str | None:
        """Why ``other``'s lock is stale, or None when it may be live (or is unknowable)."""
        if other.host != self.holder.host:
            return None
        if not self.probe.alive(other.pid):
            return f"pid {other.pid} is not running"
        if other.proc_start is not None:
            now = self.probe.start_time(other.pid)
            if now is not None and now != other.proc_start:
                return f"pid {other.pid} is now another process"
        return None

    def _take_over(self, stale_text: str) -> bool:
        """Replace the stale lock ``stale_text`` by ours; False when it changed meanwhile.

        Under an exclusive guard file: re-read the lock, and only if it is still the stale
        one, rename a fully written lock of ours over it.
        """
        guard = self.path.with_name(LOCK_NAME + TAKEOVER_SUFFIX)
        if not self._hold_guard(guard):
            return False
        try:
            text, _ = self._read(patience=0.0)
            if text != stale_text:
                return False
            write_text_atomically(self.path, self.holder.to_json(), unique=True)
            return True
        finally:
            guard.unlink(missing_ok=True)

    def _hold_guard(self, guard: Path) -> bool:
        """Create the takeover guard; wait a little for another taker, expire a crashed one."""
        for _ in range(40):
            try:
                os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                return True
            except FileExistsError:
                pass
            try:
                if time.time() - guard.stat().st_mtime > TAKEOVER_EXPIRY_S:
                    guard.unlink(missing_ok=True)
                    continue
            except FileNotFoundError:
                continue
            time.sleep(0.05)
        return False

    def _busy_message(self, other: LockHolder) -> str:
        message = (f"output.dir '{self.out_dir}' is in use by {other.describe()} "
                   f"(lock {LOCK_NAME}); ")
        if other.host != self.holder.host:
            return message + (f"this host cannot check a process on {other.host}: if that "
                              f"job is no longer running, remove the lock (rm {self.path}); "
                              f"otherwise wait for it, or choose another output.dir")
        if other.pid == self.holder.pid:
            return message + "this process holds it already; release it first"
        return message + "wait for it, or choose another output.dir"

    def _unreadable_message(self) -> str:
        return (f"output.dir '{self.out_dir}' has a lock file {LOCK_NAME} that is not a "
                f"cosmotrain lock or is damaged; if no other job uses this output.dir, remove "
                f"it (rm {self.path}), or choose another output.dir")


def _with_token(holder: LockHolder) -> LockHolder:
    return LockHolder(holder.host, holder.pid, holder.started, holder.argv, holder.job_id,
                      holder.proc_start, uuid.uuid4().hex)
