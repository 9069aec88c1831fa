"""The formats through the commands: datagen --format, convert, preload of gzip TFRecord,
and a damaged file of each format ending a 2-rank training job with one message, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, mpiexec, stderr_of, subprocess_env

from cosmotrain.data.formats import interface as formats
from cosmotrain.data.dataset import scan
from cosmotrain.data.dataset.manifest import open_manifest

TIMEOUT = 120


def datagen(cli, out: Path, *args: str) -> None:
    code, _, err = cli("datagen", "--out", str(out), "--samples", "5", "--width", "16",
                       "--seed", "4", *args)
    assert code == 0, err


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("sample_*"))}


def test_convert_round_trip_gives_the_same_bytes(cli, tmp_path: Path) -> None:
    datagen(cli, tmp_path / "gz", "--format", "tfrecord", "--gzip")
    steps = [("gz", "npy", []), ("npy", "h5", ["--format", "hdf5"]),
             ("h5", "back", ["--format", "tfrecord", "--gzip"])]
    for source, out, args in steps:
        code, stdout, err = cli("convert", "--data", str(tmp_path / source), "--out",
                                str(tmp_path / out), *(args or ["--format", "npy"]))
        assert code == 0, err
        assert "converted 5 file(s)" in stdout and "equal to its source" in stdout
    assert files_of(tmp_path / "back") == files_of(tmp_path / "gz")
    nvidia = (tmp_path / "npy" / "train" / "files_data.lst").read_text().split()
    assert nvidia == [f"sample_00000{i}_data.npy" for i in range(4)]
    assert open_manifest(tmp_path / "h5", None).volume.format == "hdf5"
    code, _, err = cli("convert", "--data", str(tmp_path / "h5"), "--out",
                       str(tmp_path / "back"), "--format", "npy")
    assert code == 2 and "is not empty" in err and err.count("error:") == 1
    code, _, err = cli("convert", "--data", str(tmp_path / "h5"), "--out",
                       str(tmp_path / "h5"), "--format", "npy", "--overwrite")
    assert code == 2 and "is the source dataset itself" in err


def test_convert_refuses_float32_into_tfrecord(cli, tmp_path: Path) -> None:
    datagen(cli, tmp_path / "f", "--dtype", "float32")
    code, _, err = cli("convert", "--data", str(tmp_path / "f"), "--out",
                       str(tmp_path / "t"), "--format", "tfrecord")
    assert code == 2 and "TFRecord holds int16 counts as written" in err
    assert not (tmp_path / "t").exists()


def test_preload_stages_gzip_files_inflated(cli, tmp_path: Path) -> None:
    datagen(cli, tmp_path / "gz", "--format", "tfrecord", "--gzip")
    args = ["--set", f"data.path={tmp_path / 'gz'}", "--set", "model.width=8",
            "--set", "train.batch_size=2", "--dest", str(tmp_path / "stage")]
    code, out, err = cli("preload", *args)
    assert code == 0, err
    assert "staged 5 file(s) (5 inflated from gzip)" in out and "GiB/s" in out
    source, staged = open_manifest(tmp_path / "gz", 8), open_manifest(tmp_path / "stage", 8)
    assert staged.files == source.files and staged.volume == source.volume
    for name in staged.files["train"]:
        assert (tmp_path / "stage" / name).read_bytes()[:2] != b"\x1f\x8b"
        assert np.array_equal(formats.read_block(tmp_path / "stage" / name, staged.volume),
                              formats.read_block(tmp_path / "gz" / name, source.volume))
    code, out, err = cli("preload", *args)
    assert code == 0 and "0.0 MiB copied" in out, err  # verified copies are kept


def test_preload_stages_nvidia_label_files_beside_their_volumes(cli, tmp_path: Path) -> None:
    datagen(cli, tmp_path / "nv", "--format", "npy")
    code, out, err = cli("preload", "--set", f"data.path={tmp_path / 'nv'}", "--set",
                         "model.width=8", "--dest", str(tmp_path / "stage"))
    assert code == 0, err
    for label in (tmp_path / "nv").rglob("*_label.npy"):
        staged = tmp_path / "stage" / label.relative_to(tmp_path / "nv")
        assert staged.read_bytes() == label.read_bytes()
    for cache in (tmp_path / "stage").glob("cosmotrain-*"):
        cache.unlink()  # labels rebuilt from the staged files alone
    staged = open_manifest(tmp_path / "stage", 8)
    np.testing.assert_array_equal(staged.labels["train"],
                                  open_manifest(tmp_path / "nv", 8).labels["train"])


def test_training_on_gzip_files_says_once_that_they_are_inflated(cli, tmp_path: Path) -> None:
    datagen(cli, tmp_path / "gz", "--format", "tfrecord", "--gzip")
    code, _, err = cli("train", "--config", str(REPO / "configs" / "tiny.yaml"),
                       "--set", "data.source=files", "--set", f"data.path={tmp_path / 'gz'}",
                       "--set", "model.width=8", "--set", "train.max_steps=2",
                       "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert err.count("are gzip streams, so every read inflates") == 1
    assert "cosmotrain preload" in err
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("*.h5"))[-1]
    code, _, err = cli("convert", "--data", str(tmp_path / "gz"), "--out",
                       str(tmp_path / "npy"), "--format", "npy")
    assert code == 0, err
    predicted = {}
    for name in ("gz", "npy"):  # predict reads every format alike, sub-cubes included
        out = tmp_path / f"{name}.h5"
        code, _, err = cli("predict", "--checkpoint", str(checkpoint), "--data",
                           str(tmp_path / name), "--out", str(out))
        assert code == 0, err
        with h5py.File(out, "r") as handle:
            predicted[name] = {split: handle[split]["prediction"][()] for split in handle}
    assert predicted["gz"].keys() == {"train", "validation"}
    assert len(predicted["gz"]["train"]) == 4 * 8  # 4 files of 16^3 = 32 cubes of 8^3
    for split, values in predicted["gz"].items():
        assert np.array_equal(values, predicted["npy"][split])


def damage(root: Path, format: str) -> tuple[Path, str]:
    """Spoil the second training file of ``root``: the file named and the message."""
    name = scan.discover(root)[1]["train"][1]  # no label table yet: the job meets the damage
    victim = root / name
    if format == "npy":
        victim.write_bytes(victim.read_bytes()[:-64])
        return victim, "bytes but its header promises"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x55
    victim.write_bytes(bytes(data))
    return victim, "payload CRC mismatch" if format == "tfrecord" else "damaged or truncated"


@pytest.mark.parametrize("args,format", [
    (["--format", "tfrecord"], "tfrecord"), (["--format", "tfrecord", "--gzip"], "gzip"),
    (["--format", "npy"], "npy")])
def test_a_damaged_file_ends_a_two_rank_job_once(cli, tmp_path: Path, args: list[str],
                                                 format: str) -> None:
    datagen(cli, tmp_path / "d", *args)
    (tmp_path / "d" / "manifest.json").unlink()  # as downloaded: found by the scan
    victim, fragment = damage(tmp_path / "d", format)
    sets = ["model.width=8", "data.source=files", f"data.path={tmp_path / 'd'}",
            f"output.dir={tmp_path / 'run'}", "train.batch_size=2", "train.max_steps=2",
            "parallel.depth=2"]
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain", "train",
           "--config", str(REPO / "configs" / "tiny.yaml")]
    cmd += [arg for item in sets for arg in ("--set", item)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=subprocess_env())
    err = stderr_of(job, format, TIMEOUT)
    assert job.returncode == 2, err
    assert err.count("cosmotrain: error:") == 1, err
    assert err.count(f"data file '{victim}'") == 1 and fragment in err, err
    assert "Traceback" not in err
