"""A sample file whose header is damaged anywhere is one line naming it, never a traceback.

h5py raises ``RuntimeError`` on a metadata checksum failure and numpy's ``.npy`` header
parser ``tokenize.TokenError`` or ``SyntaxError``; each format module turns whatever its
library raises into the one data error (``data/formats/read_errors.py``).  The first test damages
each format's header at every offset of its first bytes; the others put such a file under
every command that reads samples (``train`` with the preload and the direct reader,
``predict``, ``preload``, ``convert``), on 1 rank in-process and on 2 under mpiexec.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, mpiexec, stderr_of, subprocess_env

from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.errors import DataError

TIMEOUT = 120
TINY = str(REPO / "configs" / "tiny.yaml")
VOLUME = np.random.default_rng(3).integers(0, 9, (4, 8, 8, 8)).astype(np.float32)
LABELS = np.array([0.1, -0.2, 0.3, -0.4], np.float32)
#: The exceptions a damaged header raised before, per format; each must now be a DataError.
LIBRARY_ERRORS = {"hdf5": RuntimeError, "npy": (tokenize.TokenError, SyntaxError)}


def outcome(path: Path, damaged: Path, format: str) -> BaseException | None:
    """Probe and read ``path``: None when it reads, else the DataError, which must name
    ``damaged`` (any other exception fails the test)."""
    try:
        info, _ = formats.probe(path, format=format)
        formats.read_block(path, info)
    except DataError as err:
        assert str(damaged) in str(err) and "\n" not in str(err)
        return err
    return None


@pytest.mark.parametrize("format,name,gzip", [
    ("hdf5", "s.hdf5", False), ("npy", "s_data.npy", False), ("npy", "s_label.npy", False),
    ("tfrecord", "s.tfrecord", False), ("tfrecord", "s.tfrecord", True)])
def test_header_damage_at_every_offset_is_one_data_error(tmp_path: Path, format: str,
                                                         name: str, gzip: bool) -> None:
    sample = tmp_path / ("s_data.npy" if format == "npy" else name)
    formats.write_sample(sample, VOLUME, LABELS, format=format, gzip=gzip,
                         layout="channels-last", dtype="int16")
    damaged = tmp_path / name
    good = damaged.read_bytes()
    causes = set()
    for offset in range(min(len(good), 1024 if format == "hdf5" else 160)):
        for value in (0x00, 0xFF, 0x28):
            data = bytearray(good)
            data[offset] = value
            damaged.write_bytes(bytes(data))
            err = outcome(sample, damaged, format)
            if err is not None:
                causes.add(type(err.__cause__))
    damaged.write_bytes(good)
    assert outcome(sample, damaged, format) is None
    if format in LIBRARY_ERRORS:  # the library errors that were tracebacks were met
        assert any(issubclass(cause, LIBRARY_ERRORS[format]) for cause in causes), causes


def damage_header(path: Path, sample: Path, format: str) -> str:
    """Damage ``path``'s header where its library raises its own error (not a ValueError
    or OSError), keeping its modification time so that cached label tables still hold
    (the readers, not the label pass, meet it); returns that error's message."""
    good, stat = path.read_bytes(), path.stat()
    for offset in range(len(good)):
        data = bytearray(good)
        data[offset] = 0xFF if format == "hdf5" else 0x28
        path.write_bytes(bytes(data))
        err = outcome(sample, path, format)
        if err is not None and isinstance(err.__cause__, LIBRARY_ERRORS[format]):
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            return str(err)
    raise AssertionError(f"no offset of {path} raises {LIBRARY_ERRORS[format]}")


def datagen(cli, out: Path, format: str) -> Path:
    code, _, err = cli("datagen", "--out", str(out), "--samples", "5", "--width", "8",
                       "--seed", "4", "--format", format)
    assert code == 0, err
    return out


def one_error(code: int, err: str, victim: Path) -> None:
    """Exit 2, one error line naming ``victim``, no traceback."""
    assert code == 2, err
    assert err.count("error:") == 1 and f"data file '{victim}'" in err, err
    assert "Traceback" not in err


def train_args(data: Path, out: Path, *sets: str) -> list[str]:
    sets = ("model.width=8", "data.source=files", f"data.path={data}", f"output.dir={out}",
            "train.batch_size=2", "train.max_steps=2", *sets)
    return ["train", "--config", TINY, *(arg for item in sets for arg in ("--set", item))]


@pytest.mark.parametrize("format,label", [("hdf5", False), ("npy", False), ("npy", True)])
def test_a_damaged_header_is_one_line_in_every_command(cli, tmp_path: Path, format: str,
                                                       label: bool) -> None:
    data = datagen(cli, tmp_path / "d", format)
    code, _, err = cli(*train_args(data, tmp_path / "warm"))  # builds the label tables
    assert code == 0, err
    checkpoint = sorted((tmp_path / "warm" / "checkpoints").glob("*.h5"))[-1]
    sample = sorted((data / "train").glob("*.hdf5" if format == "hdf5" else "*_data.npy"))[1]
    victim = npy_sample.label_path(sample) if label else sample
    damage_header(victim, sample, format)
    readers = [] if label else ["preload", "direct"]  # labels: read by the label pass only
    for reader in readers:
        code, _, err = cli(*train_args(data, tmp_path / reader, f"data.reader={reader}"))
        one_error(code, err, victim)
    os.utime(victim)  # a changed file: the label pass of each command reads it again
    commands = [tuple(train_args(data, tmp_path / "labels")),
                ("predict", "--checkpoint", str(checkpoint), "--data", str(data), "--out",
                 str(tmp_path / "p.h5")),
                ("preload", "--set", f"data.path={data}", "--set", "model.width=8",
                 "--dest", str(tmp_path / "stage")),
                ("convert", "--data", str(data), "--out", str(tmp_path / "c"),
                 "--format", "npy" if format == "hdf5" else "hdf5")]
    for command in commands:
        code, _, err = cli(*command)
        one_error(code, err, victim)
    assert not (tmp_path / "p.h5").exists() and not (tmp_path / "c" / "manifest.json").exists()


def test_a_damaged_header_ends_a_two_rank_job_once_with_either_reader(cli, tmp_path: Path
                                                                     ) -> None:
    jobs = {}
    for format, reader in (("hdf5", "preload"), ("npy", "direct")):
        data = datagen(cli, tmp_path / format, format)
        code, _, err = cli(*train_args(data, tmp_path / f"warm-{format}"))
        assert code == 0, err
        pattern = "*.hdf5" if format == "hdf5" else "*_data.npy"
        victim = sorted((data / "train").glob(pattern))[1]
        damage_header(victim, victim, format)
        cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain",
               *train_args(data, tmp_path / f"run-{format}", f"data.reader={reader}",
                           "parallel.depth=2")]
        jobs[victim] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=subprocess_env())
    for victim, job in jobs.items():  # the two launches run concurrently
        err = stderr_of(job, str(victim), TIMEOUT)
        one_error(job.returncode, err, victim)
        assert err.count(f"data file '{victim}'") == 1, err
