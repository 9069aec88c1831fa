"""Starting the runs of a scale study: srun inside a Slurm allocation, mpiexec elsewhere.

The study runs once, outside any MPI job (the Slurm batch step, or a shell), and starts
each point as its own MPI job.  Under Slurm the points' srun takes its CPU, MPI and GPU
options from srun's input environment variables (``SRUN_CPUS_PER_TASK``,
``SLURM_MPI_TYPE``, ``SLURM_GPU_BIND``, ...), which ``slurm/scale_study.sbatch`` exports;
this module adds only the task and node counts.  Without Slurm, each point's ranks share
the machine's cores themselves (``runtime/threads.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cosmotrain.errors import UserError

LAUNCHERS = ("auto", "srun", "mpiexec")
TAIL_LINES = 20
TAIL_CHARS = 4000


@dataclass(frozen=True)
class Launcher:
    """How to start P ranks: ``kind`` srun, mpiexec or none (one rank, no MPI launcher)."""

    kind: str
    path: str | None
    ranks_per_node: int | None = None

    def words(self, ranks: int) -> list[str]:
        """The launcher's words for ``ranks`` ranks (empty: run the command directly)."""
        if self.kind == "srun":
            words = [str(self.path), f"--ntasks={ranks}"]
            if self.ranks_per_node:
                nodes = -(-ranks // self.ranks_per_node)
                words += [f"--nodes={nodes}",
                          f"--ntasks-per-node={min(ranks, self.ranks_per_node)}"]
            return words
        if self.kind == "mpiexec":
            return [str(self.path), "-n", str(ranks)]
        if ranks > 1:
            raise UserError(f"{ranks} ranks need mpiexec, which is not on PATH; install "
                            f"cosmotrain with its MPI (pip install -e \".[mpich]\") or load "
                            f"the site MPI")
        return []


def find_launcher(choice: str = "auto", ranks_per_node: int | None = None,
                  env: dict[str, str] | None = None) -> Launcher:
    """srun when inside an allocation (``SLURM_JOB_ID`` set, srun on PATH), else mpiexec
    (the one beside this Python first, as the mpich wheel installs it), else none."""
    env = dict(os.environ) if env is None else env
    if choice not in LAUNCHERS:
        raise UserError(f"--launcher {choice!r}: choose one of {', '.join(LAUNCHERS)}")
    srun = shutil.which("srun", path=env.get("PATH"))
    in_slurm = bool(env.get("SLURM_JOB_ID"))
    if choice == "srun" or (choice == "auto" and in_slurm and srun):
        if not (in_slurm and srun):
            raise UserError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID set) and "
                            "srun on PATH; submit with sbatch or use --launcher mpiexec")
        per_node = ranks_per_node or slurm_tasks_per_node(env)
        return Launcher("srun", srun, per_node)
    beside = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside) if beside.is_file() else shutil.which("mpiexec",
                                                                 path=env.get("PATH"))
    if mpiexec:
        return Launcher("mpiexec", mpiexec, ranks_per_node)
    if choice == "mpiexec":
        raise UserError("--launcher mpiexec: mpiexec is not on PATH; install cosmotrain with "
                        "its MPI (pip install -e \".[mpich]\") or load the site MPI")
    return Launcher("none", None, ranks_per_node)


def slurm_tasks_per_node(env: dict[str, str]) -> int | None:
    """The allocation's ``--ntasks-per-node`` (``SLURM_NTASKS_PER_NODE``: ``4`` or
    ``4(x2)``), else None (srun then places the tasks)."""
    match = re.match(r"^(\d+)", env.get("SLURM_NTASKS_PER_NODE", ""))
    return int(match.group(1)) if match and int(match.group(1)) > 0 else None


@dataclass
class RunResult:
    """A finished (or timed out) run: exit code, and the last lines of its stderr."""

    exit_code: int
    stderr_tail: str
    timed_out: bool = False


def cosmotrain_command(*args: str) -> list[str]:
    """This Python running cosmotrain (an absolute path, so compute nodes need no PATH)."""
    return [sys.executable, "-m", "cosmotrain", *args]


def run_logged(command: list[str], log_dir: Path, timeout_s: float | None = None
               ) -> RunResult:
    """Run ``command`` with stdout and stderr in ``log_dir``; kill its process group
    after ``timeout_s`` (a hung point must not stall the whole study)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            code, timed_out = _kill(proc), True
    return RunResult(code, tail(err_path.read_text(errors="replace")), timed_out)


def _kill(proc: subprocess.Popen) -> int:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()
    return 124


def tail(text: str) -> str:
    """The last lines of a log, bounded in size for results.json."""
    lines = text.rstrip().splitlines()[-TAIL_LINES:]
    return "\n".join(lines)[-TAIL_CHARS:]


_ERROR_LINE = re.compile(r"error:|^[\w.]*(Error|Exception)\b", re.IGNORECASE)


def last_error_line(text: str) -> str:
    """The last ``cosmotrain: error: ...`` or ``SomeError: ...`` line of a stderr tail (not
    the launcher's abort notice after it), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return (errors or lines or [""])[-1]
