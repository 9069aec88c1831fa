"""Error messages a newcomer meets first: each names the real problem and the option to
change (a missing dataset, a split --split asks for, a file that is no checkpoint, the
GPU extra)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi4py import MPI

from cosmotrain.config.load import load_config
from cosmotrain.data.dataset.scan import discover
from cosmotrain.device.select import INSTALL_GPU
from cosmotrain.errors import DataError
from cosmotrain.train.run import run_training

REPO = Path(__file__).resolve().parents[1]


def test_a_missing_dataset_does_not_exist_and_a_file_is_not_a_directory(
        tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*nowhere': does not exist; point data.path"):
        discover(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match=r"'.*file': is not a directory; point data.path"):
        discover(tmp_path / "file")


def test_training_on_a_missing_path_says_it_does_not_exist(cli, tmp_path: Path) -> None:
    code, _, err = cli("train", "-c", str(REPO / "configs/tiny.yaml"), "--set",
                       "data.source=files", "--set", f"data.path={tmp_path / 'nowhere'}",
                       "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "nowhere': does not exist" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step tiny run: its checkpoint and its synthetic dataset (train, validation)."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(REPO / "configs/tiny.yaml", [
        "data.synthetic.samples=10", "data.synthetic.val_fraction=0.2", "model.width=8",
        "train.max_steps=1", f"output.dir={out}"])
    run_training(cfg, MPI.COMM_WORLD)
    return out


def test_predict_names_split_and_lists_the_splits(cli, run: Path, tmp_path: Path) -> None:
    checkpoint = next((run / "checkpoints").glob("ckpt_step*.h5"))
    code, _, err = cli("predict", "--checkpoint", str(checkpoint), "--data",
                       str(run / "data"), "--out", str(tmp_path / "p.h5"), "--split", "test")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--split test:" in err and "its splits: train, validation" in err
    assert "data.path" not in err
    assert not (tmp_path / "p.h5").exists()


def test_predict_on_a_file_that_is_no_checkpoint_gives_predicts_advice(
        cli, run: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "notes.h5"
    bogus.write_text("not hdf5")
    code, _, err = cli("predict", "--checkpoint", str(bogus), "--data", str(run / "data"),
                       "--out", str(tmp_path / "p.h5"))
    assert code == 2 and str(bogus) in err
    assert "pass --checkpoint a ckpt_step*.h5 file written by cosmotrain train" in err
    assert "move it aside" not in err and "--resume" not in err


def test_the_gpu_hint_is_the_readme_install_command() -> None:
    assert INSTALL_GPU == 'pip install -e ".[gpu]" (CUDA 12) or -e ".[gpu-cuda13]" (CUDA 13)'
    assert INSTALL_GPU in (REPO / "README.md").read_text()
    for path in [*(REPO / "cosmotrain").rglob("*.py"), *(REPO / "docs").glob("*.md")]:
        assert "cosmotrain[gpu]" not in path.read_text(), path
