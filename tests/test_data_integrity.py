"""A dataset is complete or refused, and its copies are verified (issue 36, items 1 and 2).

Through the command line, in-process: a staging that a kill or a concurrent job left
without its manifest, and a conversion stopped by a full disk, are refused by ``train``,
``preload`` and ``predict`` in one line until a rerun completes them; a staged copy whose
payload is damaged is refused by its checksum (``data.verify``); an entry named like a
sample that is not a readable regular file is named; ``--resume`` accepts the same
dataset at another path or under a forced format and refuses another one.  Each case
checks the exit code, the one line naming the file or directory, and that the source and
every good file are untouched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal as signal_module
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mpiexec, stderr_of, subprocess_env
from test_data_manifest import write_universes

from cosmotrain.data.dataset import file_sums
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.copies import stage as staging
from cosmotrain.data.copies.stage_claim import record_source
from cosmotrain.errors import WriteError

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--set", "model.width=8", "--set", "train.batch_size=4"]


def train_args(data: Path, run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(REPO / "configs/tiny.yaml"), "--set", "data.source=files",
            "--set", f"data.path={data}", *SMALL, "--set", "train.max_steps=2",
            "--set", "train.checkpoint_every_steps=2", "--set", "train.epochs=10",
            "--set", f"output.dir={run}", *extra]


def preload_args(data: Path, dest: Path, *extra: str) -> list[str]:
    return ["preload", "--set", f"data.path={data}", *SMALL, "--dest", str(dest), *extra]


def datagen(cli, out: Path, seed: int = 1) -> None:
    code, _, err = cli("datagen", "--out", str(out), "--samples", "8", "--width", "8",
                       "--seed", str(seed))
    assert code == 0, err


def contents(root: Path) -> dict[Path, bytes]:
    """Every file under ``root`` but the caches a job may add (label tables)."""
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.startswith("cosmotrain-")}


def one_line(err: str, *parts: str) -> None:
    assert err.strip().count("\n") == 0, err
    for part in parts:
        assert part in err, (part, err)


def recorded_sums_match(root: Path) -> None:
    """The manifest records every file of the dataset, with its true size and CRC-32C."""
    manifest = json.loads((root / "manifest.json").read_text())
    recorded = {name: tuple(s) for name, s in manifest["checksums"]["files"].items()}
    entries = {s: names for s, entry in manifest["splits"].items()
               for names in [entry["files"]]}
    assert set(recorded) == set(file_sums.every_file(entries, manifest["format"]))
    assert recorded == file_sums.sum_files(root, recorded)


def test_an_unfinished_staging_is_refused_until_a_rerun_completes_it(
        cli, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, stage = tmp_path / "data", tmp_path / "stage"
    datagen(cli, source)
    recorded_sums_match(source)  # datagen records its checksums too
    before = contents(source)
    # a train started while preload is still writing: the record is there, one copy
    record_source(stage, source)
    shutil.copy(source / "train/sample_000000.hdf5", stage / "sample_000000.hdf5")
    code, _, err = cli(*train_args(stage, tmp_path / "run"))
    assert code == 2 and not list(tmp_path.glob("run/checkpoints/*"))
    one_line(err, f"'{stage}'", "unfinished staging", "still being written, or stopped early",
             f"run cosmotrain preload again with --dest {stage} to complete it")
    (stage / "sample_000000.hdf5").unlink()
    code, _, err = cli(*preload_args(source, stage))
    assert code == 0, err
    recorded_sums_match(stage)
    # a staging killed midway (kill -9 of a rank or of mpiexec): copies, no manifest
    (stage / "manifest.json").unlink()
    (stage / "validation/sample_000007.hdf5").unlink()
    code, _, err = cli(*train_args(stage, tmp_path / "run2"))
    assert code == 2
    one_line(err, f"'{stage}'", "unfinished staging", "cosmotrain preload again")
    code, _, err = cli(*preload_args(stage, tmp_path / "stage2"))  # preload refuses it too
    assert code == 2 and not (tmp_path / "stage2").exists()
    one_line(err, f"'{stage}'", "unfinished staging")
    code, out, err = cli(*preload_args(source, stage))  # the rerun completes it
    assert code == 0 and "staged 8 file(s)" in out, err
    recorded_sums_match(stage)
    assert contents(source) == before
    code, _, err = cli(*train_args(stage, tmp_path / "run3"))
    assert code == 0, err
    full = tmp_path / "full"  # a disk that fills at the third copy
    copy, calls = staging._copy, []

    def filling(source_file: Path, target: Path) -> int:
        calls.append(target)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return copy(source_file, target)

    monkeypatch.setattr(staging, "_copy", filling)
    code, _, err = cli(*preload_args(source, full))
    assert code == 2 and not (full / "manifest.json").exists()
    one_line(err, "No space left on device", f"'{full}/")
    assert not [p for p in full.rglob("*") if p.name.endswith(".tmp")]
    code, _, err = cli(*train_args(full, tmp_path / "run4"))
    assert code == 2
    one_line(err, f"'{full}'", "unfinished staging", f"--dest {full} to complete it")
    monkeypatch.setattr(staging, "_copy", copy)
    code, _, err = cli(*preload_args(source, full))
    assert code == 0, err
    recorded_sums_match(full)
    checkpoint = max((tmp_path / "run3/checkpoints").glob("*.h5"))
    (stage / "manifest.json").unlink()  # stopped again: predict refuses it as well
    code, _, err = cli("predict", "--checkpoint", str(checkpoint), "--data", str(stage),
                       "--out", str(tmp_path / "predicted.h5"))
    assert code == 2 and not (tmp_path / "predicted.h5").exists()
    one_line(err, f"'{stage}'", "unfinished staging")


BLOCKED_PRELOAD = """
import os, sys, time
from pathlib import Path
from mpi4py import MPI
from cosmotrain.data.copies import stage as staging
copy, signal, calls = staging._copy, Path(sys.argv[1]), []
def blocking(source, target):
    calls.append(target)
    if len(calls) == 3 and MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1:
        signal.write_text(str(os.getpid()))  # two files staged here: wait for the kill
        time.sleep(600)
    return copy(source, target)
staging._copy = blocking
sys.argv = ["cosmotrain", *sys.argv[2:]]
from cosmotrain.cli import main
main()
"""


@pytest.mark.parametrize("ranks, victim", [(1, "rank"), (2, "rank"), (2, "mpiexec")])
def test_kill_9_of_preload_midway_leaves_a_directory_train_refuses(
        cli, tmp_path, ranks: int, victim: str) -> None:
    """A real ``kill -9`` while the preload copies its third file: of the preload process,
    of its last rank under mpiexec (which then ends the job), or of mpiexec itself (whose
    proxies then end the ranks)."""
    source, stage, signal = tmp_path / "data", tmp_path / "stage", tmp_path / "copying"
    datagen(cli, source)
    launcher = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    job = subprocess.Popen([*launcher, sys.executable, "-c", BLOCKED_PRELOAD, str(signal),
                            *preload_args(source, stage)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.monotonic() + 60
    while not signal.exists() or not signal.read_text():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "preload never reached its third copy"
        time.sleep(0.05)
    rank = int(signal.read_text())
    os.kill(job.pid if victim == "mpiexec" else rank, signal_module.SIGKILL)
    stderr_of(job, "preload after kill -9", 60)
    assert job.returncode != 0
    deadline = time.monotonic() + 30  # orphaned ranks are ended by hydra's proxies
    while Path(f"/proc/{rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{rank}").exists(), "a rank outlived the kill of mpiexec"
    assert len(list(stage.rglob("*.hdf5"))) < 8 and not (stage / "manifest.json").exists()
    code, _, err = cli(*train_args(stage, tmp_path / "run"))
    assert code == 2
    one_line(err, f"'{stage}'", "unfinished staging", f"--dest {stage} to complete it")
    code, out, err = cli(*preload_args(source, stage))
    assert code == 0 and "staged 8 file(s)" in out, err
    recorded_sums_match(stage)


def test_preload_overwrite_starts_over_and_keeps_what_dest_held(cli, tmp_path) -> None:
    source, other, stage = tmp_path / "data", tmp_path / "other", tmp_path / "stage"
    datagen(cli, source)
    datagen(cli, other, seed=2)
    code, _, err = cli(*preload_args(other, stage))
    assert code == 0, err
    held = contents(stage)
    code, _, err = cli(*preload_args(source, stage))
    assert code == 2 and "holds a staging of" in err
    code, out, err = cli(*preload_args(source, stage, "--overwrite"))
    assert code == 0 and "staged 8 file(s)" in out, err
    kept = list(tmp_path.glob("stage.previous-*"))
    assert len(kept) == 1 and f"moved what {stage} held to {kept[0]}" in out
    assert contents(kept[0]) == held  # never deleted
    recorded_sums_match(stage)
    code, _, err = cli(*preload_args(source, tmp_path, "--overwrite"))
    assert code == 2 and source.is_dir()
    one_line(err, f"--dest '{tmp_path}' holds the dataset; --overwrite would move it")


def test_a_conversion_stopped_by_a_full_disk_is_refused_until_rerun(
        cli, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, out = tmp_path / "data", tmp_path / "npy"
    datagen(cli, source)
    before = contents(source)
    write, calls = formats.write_sample, []

    def full_disk(path: Path, *args: object, **kwargs: object) -> Path:
        calls.append(path)
        if len(calls) == 3:
            raise WriteError(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "--out")
        return write(path, *args, **kwargs)

    monkeypatch.setattr(formats, "write_sample", full_disk)
    code, _, err = cli("convert", "--data", str(source), "--out", str(out), "--format", "npy")
    assert code == 2
    one_line(err, f"'{calls[2]}'", "No space left on device")
    assert not (out / "manifest.json").exists() and (out / ".cosmotrain-convert.json").exists()
    code, _, err = cli(*train_args(out, tmp_path / "run"))
    assert code == 2
    one_line(err, f"'{out}'", "unfinished conversion of",
             f"run cosmotrain convert again with --out {out} to complete it")
    monkeypatch.setattr(formats, "write_sample", write)
    code, stdout, err = cli("convert", "--data", str(source), "--out", str(out),
                            "--format", "npy")  # no --overwrite needed to complete it
    assert code == 0 and "converted 8 file(s)" in stdout, err
    recorded_sums_match(out)
    assert contents(source) == before
    held = contents(out)
    code, stdout, err = cli("convert", "--data", str(source), "--out", str(out),
                            "--format", "hdf5", "--overwrite")  # starts over, keeps npy/
    kept = list(tmp_path.glob("npy.previous-*"))
    assert code == 0 and len(kept) == 1 and f"moved what {out} held to {kept[0]}" in stdout
    assert contents(kept[0]) == held
    recorded_sums_match(out)


def test_a_damaged_copy_is_named_by_its_checksum_and_restaged(cli, tmp_path) -> None:
    source, stage = tmp_path / "data", tmp_path / "stage"
    datagen(cli, source)
    code, _, err = cli(*preload_args(source, stage))
    assert code == 0, err
    damaged = stage / "train/sample_000003.hdf5"
    payload = bytearray(damaged.read_bytes())
    payload[len(payload) // 2] ^= 0x40  # one bit inside the volume: the reader sees nothing
    damaged.write_bytes(bytes(payload))
    code, _, err = cli(*train_args(stage, tmp_path / "run"))
    assert code == 2 and not (tmp_path / "run/checkpoints").exists()
    one_line(err, f"'{damaged}'", "does not match its CRC-32C in manifest.json",
             "stage or convert it again from the source")
    code, _, err = cli(*preload_args(stage, tmp_path / "s2"))  # checked as it is copied
    assert code == 2
    one_line(err, f"'{damaged}'", "does not match its CRC-32C in manifest.json",
             "restore it before staging it")
    assert not (tmp_path / "s2/train/sample_000003.hdf5").exists()
    assert not (tmp_path / "s2/manifest.json").exists()  # refused as unfinished
    code, _, err = cli(*preload_args(source, stage))  # the rerun replaces the damaged copy
    assert code == 0, err
    assert damaged.read_bytes() == (source / "train/sample_000003.hdf5").read_bytes()
    scanned = tmp_path / "scanned"
    write_universes(scanned, 8, 2, "channels-last", "int16")
    code, _, err = cli(*preload_args(scanned, tmp_path / "s3", "--set", "data.verify=always"))
    assert code == 2
    one_line(err, f"data.verify is always but '{scanned}' records no checksums")
    code, _, err = cli(*train_args(stage, tmp_path / "run2", "--set", "data.verify=always"))
    assert code == 0, err


def test_entries_that_are_not_readable_files_are_named(cli, tmp_path) -> None:
    data = tmp_path / "data"
    write_universes(data, 8, 3, "channels-last", "int16")  # scanned: no manifest
    cases = {"a dangling symbolic link": lambda p: p.symlink_to(tmp_path / "purged.hdf5"),
             "a directory": lambda p: p.mkdir(),
             "not a regular file (a FIFO": lambda p: os.mkfifo(p)}
    for kind, make in cases.items():
        entry = data / "train/universe_009.hdf5"
        make(entry)
        code, out, err = cli(*preload_args(data, tmp_path / "stage"))
        assert code == 2 and not out
        one_line(err, f"'{entry}'", f"is {kind}", "1 such entry in", "restore it or move it")
        entry.rmdir() if entry.is_dir() else entry.unlink()
    assert not (tmp_path / "stage").exists()


def test_resume_takes_the_same_dataset_at_another_path_and_refuses_another(
        cli, tmp_path) -> None:
    source, stage, other = tmp_path / "data", tmp_path / "stage", tmp_path / "other"
    datagen(cli, source)
    datagen(cli, other, seed=2)  # the same names and shapes, other universes
    code, _, err = cli(*preload_args(source, stage))
    assert code == 0, err
    run = tmp_path / "run"
    code, _, err = cli(*train_args(source, run))
    assert code == 0, err
    code, out, err = cli(*train_args(stage, run, "--set", "train.max_steps=3",
                                   "--set", "train.checkpoint_every_steps=1",
                                   "--set", "data.format=hdf5", "--resume"))
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("resume: data.")]
    assert len(lines) == 2 and lines[1].startswith("resume: data.format auto -> hdf5")
    assert all("(the same dataset (identity " in line for line in lines), out
    kept = contents(run / "checkpoints")
    code, out, err = cli(*train_args(other, run, "--set", "train.max_steps=4", "--resume"))
    assert code == 2
    one_line(err, "cannot resume from", "the config differs in data.path (")
    assert contents(run / "checkpoints") == kept


@pytest.mark.parametrize("fmt, reader", [("tfrecord", "preload"), ("tfrecord", "direct"),
                                         ("npy", "preload"), ("npy", "direct")])
def test_a_damaged_payload_is_named_in_every_format_and_reader(
        cli, tmp_path, fmt: str, reader: str) -> None:
    """One bit flipped inside a staged sample's payload, which no header check sees: the
    job names the file before its first step, whichever reader reads it; by the
    manifest's CRC-32C, or for a TFRecord by the record's own payload CRC, which the
    label pass checks first."""
    source, stage = tmp_path / "data", tmp_path / "stage"
    code, _, err = cli("datagen", "--out", str(source), "--samples", "8", "--width", "8",
                       "--format", fmt)
    assert code == 0, err
    code, _, err = cli(*preload_args(source, stage))
    assert code == 0, err
    manifest = json.loads((stage / "manifest.json").read_text())
    damaged = stage / manifest["splits"]["train"]["files"][3]
    payload = bytearray(damaged.read_bytes())
    payload[len(payload) // 2] ^= 0x40
    damaged.write_bytes(bytes(payload))
    code, _, err = cli(*train_args(stage, tmp_path / "run", "--set", f"data.reader={reader}"))
    assert code == 2 and not (tmp_path / "run/checkpoints").exists()
    one_line(err, f"'{damaged}'", "payload CRC mismatch" if fmt == "tfrecord"
             else "does not match its CRC-32C in manifest.json")
