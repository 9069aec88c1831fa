"""``cosmotrain predict`` end to end: dataset order, values, labels, at 1 and 4 ranks.

The reference is a direct forward pass: the serial model with the checkpoint's arrays
loaded by name, run in evaluation mode on each sample file read on its own.  Predict
must give the same rows in the same order under every layout (sample parallel with a
partial last batch, spatial blocks), and the MAE of the labelled rows.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, mpiexec, subprocess_env

from cosmotrain.config.load import config_from_mapping
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.readers.transform import apply_transform
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.train.checkpoints.checkpoint import load_checkpoint

TRAIN = ["model.name=tiny", "model.width=12", "model.batchnorm=true", "data.source=synthetic",
         "data.synthetic.samples=19", "data.synthetic.val_fraction=0.2", "train.batch_size=4",
         "train.epochs=1", "optimizer.name=adam"]


def run_cli(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cosmotrain", *args]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    return subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run directory with a checkpoint (BN statistics updated) and its dataset."""
    out = tmp_path_factory.mktemp("trained")
    sets = [arg for item in [*TRAIN, f"output.dir={out}"] for arg in ("--set", item)]
    done = run_cli("train", *sets)
    assert done.returncode == 0, done.stderr
    return out


def checkpoint_of(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("ckpt_step*.h5"))[-1]


def direct_forward(checkpoint: Path, files: list[Path]) -> np.ndarray:
    """Each file through the serial model with the checkpoint's arrays, one at a time."""
    import yaml

    state = load_checkpoint(checkpoint)
    cfg = config_from_mapping(yaml.safe_load(state.config_yaml))
    model = build_model(cfg.model, seed=123)  # every array is overwritten below
    for name, param in model.named_parameters():
        param.data[...] = state.params[name]
    for name, layer, key in model.named_buffers():
        layer.buffers[key] = np.asarray(state.buffers[name]).astype(
            np.asarray(layer.buffers[key]).dtype)
    rows = []
    for path in files:
        volume, _ = formats.read_sample(path)
        x = apply_transform(volume[None], cfg.data.transform)
        rows.append(model.forward(x, Context(training=False, seed=0))[0])
    return np.array(rows, dtype=np.float32)


def read_predictions(path: Path) -> dict[str, dict]:
    with h5py.File(path, "r") as f:
        return {split: {"prediction": g["prediction"][()], "target": g["target"][()],
                        "file": list(g["file"].asstr()[()]), "cube": g["cube"][()],
                        "attrs": dict(g.attrs)} for split, g in f.items()}


@pytest.mark.parametrize("ranks,sets", [
    (1, []),
    (4, []),  # every rank a sample group: 15 training rows = 3 batches of 4 + 3
    (4, ["parallel.depth=2", "parallel.height=2"]),  # spatial blocks, gathered to samples
], ids=["1-rank", "N4", "D2H2"])
def test_predictions_match_a_direct_forward_pass_in_dataset_order(
        trained: Path, tmp_path: Path, ranks: int, sets: list[str]) -> None:
    out = tmp_path / "preds.h5"
    done = run_cli("predict", "--checkpoint", str(checkpoint_of(trained)), "--data",
                   str(trained / "data"), "--out", str(out),
                   *[arg for item in sets for arg in ("--set", item)], ranks=ranks)
    assert done.returncode == 0, done.stderr
    assert "validation: 4 sample(s), 4 labelled: MAE" in done.stdout
    found = read_predictions(out)
    assert sorted(found) == ["train", "validation"]
    for split, result in found.items():
        files = [trained / "data" / name for name in result["file"]]
        assert [p.name for p in files] == sorted(p.name for p in files)  # dataset order
        assert len(set(files)) == len(files) == {"train": 15, "validation": 4}[split]
        expected = direct_forward(checkpoint_of(trained), files)
        np.testing.assert_allclose(result["prediction"], expected, rtol=1e-4, atol=1e-5)
        labels = np.array([formats.probe(p)[1] for p in files])
        np.testing.assert_array_equal(result["target"], labels)
        mae = np.abs(expected.astype(np.float64) - labels).mean(axis=0)
        np.testing.assert_allclose(result["attrs"]["mae"], mae, rtol=1e-4)
        assert result["attrs"]["labelled"] == len(files)


def test_unlabelled_files_get_predictions_and_no_mae(trained: Path, tmp_path: Path) -> None:
    data = tmp_path / "unlabelled"
    data.mkdir()
    sources = sorted((trained / "data" / "validation").glob("*.hdf5"))
    for source in sources:
        shutil.copy(source, data / source.name)
        with h5py.File(data / source.name, "a") as f:
            del f[formats.LABELS_DATASET]
    out = tmp_path / "preds.h5"
    done = run_cli("predict", "--checkpoint", str(checkpoint_of(trained)), "--data",
                   str(data), "--out", str(out), "--batch-size", "3")
    assert done.returncode == 0, done.stderr
    assert "no labels (no MAE)" in done.stdout
    result = read_predictions(out)["train"]  # a flat directory is one split
    assert np.isnan(result["target"]).all() and "mae" not in result["attrs"]
    np.testing.assert_allclose(result["prediction"],
                               direct_forward(checkpoint_of(trained), sources),
                               rtol=1e-4, atol=1e-5)
    sets = [arg for item in [*TRAIN, "data.source=files", f"data.path={data}",
                             f"output.dir={tmp_path / 'run'}"] for arg in ("--set", item)]
    refused = run_cli("train", *sets)
    assert refused.returncode == 2
    assert "has no 'unitPar' labels" in refused.stderr


def test_a_csv_out_holds_the_same_rows_as_the_hdf5_file(trained: Path, tmp_path: Path) -> None:
    import csv

    for name in ("p.h5", "p.csv"):
        done = run_cli("predict", "--checkpoint", str(checkpoint_of(trained)), "--data",
                       str(trained / "data"), "--out", str(tmp_path / name), ranks=2)
        assert done.returncode == 0, done.stderr
    with open(tmp_path / "p.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["split", "file", "cube", *(f"prediction_{i}" for i in range(4)),
                             *(f"target_{i}" for i in range(4))]
    found = read_predictions(tmp_path / "p.h5")
    assert [r["split"] for r in rows] == ["train"] * 15 + ["validation"] * 4
    for split, result in found.items():
        mine = [r for r in rows if r["split"] == split]
        assert [r["file"] for r in mine] == result["file"]
        assert [int(r["cube"]) for r in mine] == result["cube"].tolist()
        for kind in ("prediction", "target"):
            table = np.array([[float(r[f"{kind}_{i}"]) for i in range(4)] for r in mine],
                             dtype=np.float32)
            np.testing.assert_array_equal(table, result[kind])  # 9 digits: exact float32
    nan_row = csv_text_with_a_nan_target()
    assert nan_row.endswith(",nan,nan,nan,nan")


def test_existing_predictions_are_kept_unless_overwrite(trained: Path, tmp_path: Path) -> None:
    out = tmp_path / "earlier.csv"
    out.write_text("another run's predictions\n")
    args = ["predict", "--checkpoint", str(checkpoint_of(trained)), "--data",
            str(trained / "data"), "--out", str(out), "--split", "validation"]
    refused = run_cli(*args, ranks=2)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.count(f"--out '{out}' already exists; pass --overwrite") == 1
    assert out.read_text() == "another run's predictions\n"
    done = run_cli(*args, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert out.read_text().startswith("split,file,cube,")


def csv_text_with_a_nan_target() -> str:
    """The CSV row of an unlabelled sample (its targets are NaN)."""
    from cosmotrain.train.predict import SplitPredictions, csv_text

    result = SplitPredictions("train", np.full((1, 4), 0.25, np.float32),
                              np.full((1, 4), np.nan, np.float32), ["a.h5"],
                              np.zeros(1, np.int32))
    text = csv_text({"train": result}).splitlines()
    assert text[1].startswith("train,a.h5,0,0.25,0.25,0.25,0.25")
    return text[1]


def test_bad_predict_arguments_exit_2(trained: Path, tmp_path: Path) -> None:
    data = str(trained / "data")
    missing = run_cli("predict", "--checkpoint", str(tmp_path / "nope.h5"), "--data", data,
                      "--out", str(tmp_path / "p.h5"))
    assert missing.returncode == 2
    assert f"checkpoint '{tmp_path / 'nope.h5'}': not found" in missing.stderr
    split = run_cli("predict", "--checkpoint", str(checkpoint_of(trained)), "--data", data,
                    "--out", str(tmp_path / "p.h5"), "--split", "test")
    assert split.returncode == 2 and "--split test: dataset" in split.stderr
    assert "its splits: train, validation" in split.stderr
    assert not (tmp_path / "p.h5").exists()


def test_out_is_checked_before_anything_is_loaded(tmp_path: Path) -> None:
    """A directory as --out (or an unwritable one: test_write_failures.py) is refused
    before the checkpoint is read: the checkpoint here does not even exist."""
    missing = str(tmp_path / "nope.h5")
    done = run_cli("predict", "--checkpoint", missing, "--data", str(tmp_path), "--out",
                   str(tmp_path))
    assert done.returncode == 2
    assert "is a directory; name an HDF5 file" in done.stderr
    assert "not found" not in done.stderr and "Traceback" not in done.stderr
    blocked = tmp_path / "file"
    blocked.write_text("x")
    done = run_cli("predict", "--checkpoint", missing, "--data", str(tmp_path), "--out",
                   str(blocked / "p.h5"), ranks=2)
    assert done.returncode == 2
    assert done.stderr.count(f"cannot write '{blocked}': it is a file") == 1  # rank 0 only
