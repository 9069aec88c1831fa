"""`cosmotrain datagen` end to end: the issue's exact command is deterministic, and the
files do not depend on the number of ranks that wrote them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

from conftest import mpiexec, subprocess_env


def read_full(root: Path) -> dict[str, np.ndarray]:
    arrays = {}
    for path in sorted(root.glob("*/sample_*.hdf5")):
        with h5py.File(path, "r") as handle:
            arrays[str(path.relative_to(root))] = handle["full"][...]
    return arrays


def test_same_command_twice_gives_identical_full_arrays(cli, tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        code, _, err = cli("datagen", "--out", str(tmp_path / name), "--samples", "64",
                           "--width", "64", "--seed", "1")
        assert code == 0, err
        runs.append(read_full(tmp_path / name))
    assert len(runs[0]) == 64 and runs[0].keys() == runs[1].keys()
    for key, array in runs[0].items():
        assert array.shape == (64, 64, 64, 4) and array.dtype == np.int16
        assert np.array_equal(array, runs[1][key])
    with h5py.File(tmp_path / "a/train/sample_000000.hdf5", "r") as handle:
        assert handle["unitPar"].shape == (4,) and handle["unitPar"].dtype == np.float32


def test_two_ranks_write_the_same_dataset_as_one(cli, tmp_path: Path) -> None:
    code, _, err = cli("datagen", "--out", str(tmp_path / "serial"), "--samples", "6",
                       "--width", "16", "--seed", "4", "--layout", "channels-first")
    assert code == 0, err
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain", "datagen", "--out",
           str(tmp_path / "mpi"), "--samples", "6", "--width", "16", "--seed", "4",
           "--layout", "channels-first"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    serial, parallel = read_full(tmp_path / "serial"), read_full(tmp_path / "mpi")
    assert serial.keys() == parallel.keys()
    assert all(np.array_equal(serial[k], parallel[k]) for k in serial)
    assert next(iter(serial.values())).shape == (4, 16, 16, 16)
    manifests = [(tmp_path / d / "manifest.json").read_text() for d in ("serial", "mpi")]
    assert manifests[0] == manifests[1]
