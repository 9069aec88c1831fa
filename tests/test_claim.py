"""Claiming output.dir for a run (``train/claim.py``), on one rank (``COMM_SELF``).

The claim holds the run lock from the moment it succeeds until ``release``; a refused
claim (the directory holds another run, another live job holds the lock) leaves no lock
behind; ``resume`` accepts another run's outputs, ``fresh`` does not; ``overwrite`` moves
them aside only when asked, through ``move_aside_outputs``.  The lock's own rules (stale
holders, other hosts, races) are in test_rundir.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cosmotrain.errors import UserError
from cosmotrain.train.claim import claim_output_dir, move_aside_outputs
from cosmotrain.files.run_lock import LOCK_NAME, LockHolder


def comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def a_finished_run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')


def test_a_claim_holds_the_lock_until_released(tmp_path: Path) -> None:
    out = tmp_path / "run"
    claim = claim_output_dir(out, comm(), "fresh", job_id="77")
    assert claim.out_dir == out and claim.notes == []
    assert '"job_id": "77"' in (out / LOCK_NAME).read_text()
    with pytest.raises(UserError, match="this process holds it already"):
        claim_output_dir(out, comm(), "resume")
    claim.release()
    claim.release()                                       # safe twice
    assert not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("mode", ["resume", "overwrite"])
def test_resume_and_overwrite_accept_another_runs_outputs_and_move_nothing(
        tmp_path: Path, mode: str) -> None:
    a_finished_run(tmp_path)
    claim = claim_output_dir(tmp_path, comm(), mode)
    assert (tmp_path / "metrics.jsonl").exists() and claim.notes == []
    claim.release()


def test_a_refused_fresh_claim_leaves_no_lock(tmp_path: Path) -> None:
    a_finished_run(tmp_path)
    with pytest.raises(UserError, match="already holds a run"):
        claim_output_dir(tmp_path, comm(), "fresh")
    assert not (tmp_path / LOCK_NAME).exists()


def test_overwrite_moves_the_run_aside_and_a_stale_lock_is_noted(tmp_path: Path) -> None:
    a_finished_run(tmp_path)
    gone = LockHolder(host=socket.gethostname(), pid=2**22 + 17,
                      started=0.0, token="gone")       # above any pid_max: a stale lock
    (tmp_path / LOCK_NAME).write_text(gone.to_json())
    claim = claim_output_dir(tmp_path, comm(), "overwrite")
    assert len(claim.notes) == 1 and "replaced the stale lock" in claim.notes[0]
    notes = move_aside_outputs(claim, comm())
    assert len(notes) == 1 and "moved the previous run's outputs" in notes[0]
    assert not (tmp_path / "metrics.jsonl").exists()
    assert [p.name for p in tmp_path.glob("previous-*/metrics.jsonl")] == ["metrics.jsonl"]
    assert move_aside_outputs(claim, comm()) == []        # nothing left to move
    claim.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_an_unknown_mode_is_a_bug(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        claim_output_dir(tmp_path, comm(), "append")
