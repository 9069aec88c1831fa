"""Global options: ``-v`` / ``--log-level`` (rank-tagged stdlib logging on stderr, quiet by
default, other ranks at warnings unless -v) and ``--help`` showing flags as flags."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cosmotrain import logs

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
HOST = socket.gethostname().split(".")[0]


@pytest.fixture(autouse=True)
def quiet_again() -> Iterator[None]:
    """Each test starts and ends with the default set-up (warnings, rank from MPI)."""
    logs.setup_logging()
    yield
    logs.setup_logging()


def run_args(tmp_path: Path) -> list[str]:
    sets = ["data.synthetic.samples=10", "data.synthetic.val_fraction=0.2", "model.width=8",
            "train.max_steps=2", f"output.dir={tmp_path / 'run'}"]
    return ["train", "-c", str(TINY), *[a for s in sets for a in ("--set", s)]]


def test_verbose_emits_rank_tagged_debug_lines(cli, tmp_path: Path) -> None:
    code, out, err = cli("-v", *run_args(tmp_path))
    assert code == 0, err
    lines = err.splitlines()
    tag = f"[rank 0 {HOST}] "
    assert any(line.startswith(tag + "cosmotrain.train.job_setup: layout N1 on 1 rank(s)")
               for line in lines), err
    assert any(line.startswith(tag + "cosmotrain.data.readers.job_readers: split train: 8 sample(s), "
                               "preload reader") and "MiB stored" in line for line in lines)
    assert any(line.startswith(tag + "cosmotrain.train.checkpoints.checkpoint: checkpoint ") and
               "ckpt_step0000002.h5 written" in line for line in lines)
    assert "[rank" not in out  # the console (stdout) stays the progress and results


def test_default_is_quiet(cli, tmp_path: Path) -> None:
    code, _, err = cli(*run_args(tmp_path))
    assert code == 0, err
    assert "[rank" not in err and err.strip() == ""


def test_log_level_is_rank_0s_and_other_ranks_keep_to_warnings(
        capsys: pytest.CaptureFixture) -> None:
    log = logging.getLogger("cosmotrain.test")
    logs.setup_logging(logging.DEBUG, rank=3)
    log.debug("hidden")
    log.warning("shown")
    assert capsys.readouterr().err == f"[rank 3 {HOST}] cosmotrain.test: shown\n"
    logs.setup_logging(logging.DEBUG, rank=3, every_rank=True)  # -v
    log.debug("now shown")
    assert "now shown" in capsys.readouterr().err
    logs.setup_logging(logging.INFO, rank=0)
    log.debug("below the level")
    log.info("rank 0 at info")
    assert capsys.readouterr().err == f"[rank 0 {HOST}] cosmotrain.test: rank 0 at info\n"


def test_a_bad_log_level_is_one_line_exit_2(cli) -> None:
    code, _, err = cli("--log-level", "loud", "config")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--log-level" in err and "debug, info, warning, error" in err


@pytest.mark.parametrize("command", [[], ["train"], ["info"], ["predict"], ["datagen"],
                                     ["config"], ["plan"]])
def test_help_shows_flags_without_a_value_type(cli, command: list[str]) -> None:
    code, out, _ = cli(*command, "--help")
    assert code == 0 and "--help" in out
    assert "<bool>" not in out
    if command == ["train"]:
        assert "--resume" in out and "--dry-run" in out and "<path>" in out  # types remain
