"""The sample tables follow the files: an entry is read again when its file's size or
modification time changed (only that entry), a table from before the stats is rebuilt,
and the tables that staging and ``convert`` write are valid for the files they wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import abort_on_error, mpiexec, subprocess_env
from test_data_manifest import write_universes

from cosmotrain.data.dataset import cache, sample_table
from cosmotrain.data.formats import interface as formats, npy as npy_sample
from cosmotrain.data.dataset.manifest import MANIFEST_NAME, open_manifest
from cosmotrain.data.copies.stage_claim import record_source
from cosmotrain.errors import DataError

ARGS = ["--set", "model.width=4", "--set", "train.batch_size=2"]


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files the label and mean passes open from now on, by name."""
    opened: list[str] = []
    probe, mean = formats.probe, sample_table.cube_mean

    def counted_probe(path: Path, *args: object, **kw: object) -> object:
        opened.append(Path(path).name)
        return probe(path, *args, **kw)

    def counted_mean(path: Path, *args: object) -> float:
        opened.append(Path(path).name)
        return mean(path, *args)
    monkeypatch.setattr(formats, "probe", counted_probe)
    monkeypatch.setattr(sample_table, "cube_mean", counted_mean)
    return opened


def no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any label or mean read from now on fails the test."""
    def refuse(path: Path, *args: object, **kw: object) -> None:
        raise AssertionError(f"'{path}' was read although the cached table is valid")
    monkeypatch.setattr(formats, "probe", refuse)
    monkeypatch.setattr(sample_table, "cube_mean", refuse)


def rewrite(path: Path, labels: np.ndarray, fill: float, **kw: object) -> None:
    """Replace a sample file under its own name, as a foreign tool would, and move its
    modification time on (a rewrite within the file system's time resolution would
    otherwise keep it)."""
    before = path.stat().st_mtime_ns
    volume = np.full((4, 8, 8, 8), fill, dtype=np.float32)
    formats.write_sample(path, volume, labels, **kw)
    os.utime(path, ns=(before + 10**9, before + 10**9))


def test_a_file_replaced_under_its_name_is_read_again_and_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_universes(tmp_path, 8, 3, "channels-last", "int16")
    first = open_manifest(tmp_path, 4, means=True)
    opened = count_reads(monkeypatch)
    again = open_manifest(tmp_path, 4, means=True)
    assert opened == []  # nothing changed: both tables come from the cache
    np.testing.assert_array_equal(again.labels["train"], first.labels["train"])

    new_labels = np.array([0.5, -0.25, 0.125, 1.0], dtype=np.float32)
    rewrite(tmp_path / "train/universe_001.hdf5", new_labels, 7.0,
            layout="channels-last", dtype="int16")
    changed = open_manifest(tmp_path, 4, means=True)
    assert opened == ["universe_001.hdf5"] * (1 + 8)  # its labels, then its 8 cube means
    np.testing.assert_array_equal(changed.labels["train"][1], new_labels)
    np.testing.assert_array_equal(changed.labels["train"][[0, 2]], first.labels["train"][[0, 2]])
    np.testing.assert_array_equal(changed.means["train"][8:16], np.full(8, 7.0))
    np.testing.assert_array_equal(changed.means["train"][:8], first.means["train"][:8])
    np.testing.assert_array_equal(changed.means["validation"], first.means["validation"])
    opened.clear()
    open_manifest(tmp_path, 4, means=True)
    assert opened == []  # the refreshed tables were stored with the new stats


def test_a_dataset_rewritten_under_the_same_names_is_rescanned(tmp_path: Path) -> None:
    """Wider volumes under the old names: the scan cache and the tables follow, nothing
    needs deleting."""
    write_universes(tmp_path, 4, 2, "channels-last", "int16", val_files=1)
    assert open_manifest(tmp_path, 4).disk_width == 4
    before = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/*.hdf5")}
    write_universes(tmp_path, 8, 2, "channels-last", "int16", val_files=1, seed=5)
    for path, mtime in before.items():  # the rewrite moves every mtime on
        os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    manifest = open_manifest(tmp_path, 4)
    assert manifest.disk_width == 8 and manifest.count("train") == 16
    with h5py.File(tmp_path / "train/universe_001.hdf5") as handle:
        np.testing.assert_array_equal(manifest.labels["train"][1], handle["unitPar"][()])


def test_a_removed_label_file_is_noticed(tmp_path: Path) -> None:
    """NVIDIA's labels live in their own file: its stats are part of the key."""
    rng = np.random.default_rng(1)
    (tmp_path / "train").mkdir()
    for i in range(2):
        volume = rng.poisson(2.0, size=(4, 4, 4, 4)).astype(np.float32)
        formats.write_sample(tmp_path / f"train/s{i}_data.npy", volume, rng.uniform(-1, 1, 4),
                             format=formats.NPY, layout="channels-last", dtype="int16")
    assert not np.isnan(open_manifest(tmp_path, 4).labels["train"]).any()
    npy_sample.label_path(tmp_path / "train/s1_data.npy").unlink()
    labels = open_manifest(tmp_path, 4).labels["train"]
    assert not np.isnan(labels[0]).any() and np.isnan(labels[1]).all()  # now unlabelled


def test_a_table_from_before_the_stats_is_read_again_for_the_files_present(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local-shuffle stage of an earlier version lacks most files: those keep their
    entries, the others are read again once, and the table is stored with stats."""
    write_universes(tmp_path, 4, 3, "channels-last", "int16", val_files=1)
    (tmp_path / "train.txt").write_text("".join(f"train/universe_{i:03d}.hdf5\n"
                                                for i in range(3)))
    (tmp_path / "val.txt").write_text("validation/universe_000.hdf5\n")
    manifest = open_manifest(tmp_path, 4)
    files = {split: list(names) for split, names in manifest.files.items()}
    old = {f"table_{s}": manifest.labels[s] for s in files}  # the layout of earlier versions
    old.update({f"key_{s}": np.array(cache.files_key(names)) for s, names in files.items()})
    cache.write_npz(tmp_path / sample_table.LABELS_NAME, old)
    (tmp_path / "train/universe_002.hdf5").unlink()  # not staged on this node
    opened = count_reads(monkeypatch)
    again = open_manifest(tmp_path, 4)
    assert sorted(opened) == ["universe_000.hdf5"] * 2 + ["universe_001.hdf5"]
    np.testing.assert_array_equal(again.labels["train"], manifest.labels["train"])
    with np.load(tmp_path / sample_table.LABELS_NAME) as stored:
        assert stored["stat_train"].shape == (3, sample_table.STAT_FIELDS)
        assert stored["stat_train"][2].tolist() == [-1, -1, -1, -1]
    opened.clear()
    open_manifest(tmp_path, 4)
    assert opened == []


def test_a_vanished_file_is_named(tmp_path: Path) -> None:
    write_universes(tmp_path, 4, 2, "channels-last", "int16", val_files=0)
    (tmp_path / "train.txt").write_text("train/universe_000.hdf5\ntrain/universe_001.hdf5\n")
    open_manifest(tmp_path, 4)
    (tmp_path / "train/universe_001.hdf5").unlink()  # the list still names it
    with pytest.raises(DataError, match="universe_001.hdf5"):
        open_manifest(tmp_path, 4)


def test_staged_and_converted_tables_are_valid_for_the_new_files(
        cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies have new modification times; their tables are keyed on them."""
    write_universes(tmp_path / "data", 4, 3, "channels-last", "int16")
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'data'}", *ARGS,
                       "--dest", str(tmp_path / "stage"))
    assert code == 0, err
    code, _, err = cli("convert", "--data", str(tmp_path / "data"), "--out",
                       str(tmp_path / "npy"), "--format", "npy")
    assert code == 0, err
    labels = open_manifest(tmp_path / "data", 4).labels
    no_reads(monkeypatch)
    for copy in ("stage", "npy"):
        np.testing.assert_array_equal(open_manifest(tmp_path / copy, 4).labels["train"],
                                      labels["train"])


def test_staging_failures_on_two_ranks_are_one_verdict(tmp_path: Path) -> None:
    """Each rank fails on a file of its own: one line, exit 2, no manifest written."""
    write_universes(tmp_path / "data", 4, 3, "channels-last", "int16", val_files=1)
    record_source(tmp_path / "stage", tmp_path / "data")  # an interrupted staging of it
    for name in ("universe_000.hdf5", "universe_001.hdf5"):  # one per rank of the node
        (tmp_path / "stage/train" / name / "in-the-way").mkdir(parents=True)
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain", "preload",
           "--set", f"data.path={tmp_path / 'data'}", *ARGS, "--dest", str(tmp_path / "stage")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "universe_000.hdf5" in errors[0], out.stderr
    assert not (tmp_path / "stage" / MANIFEST_NAME).exists()


@pytest.mark.parallel(nprocs=2)
@abort_on_error
def test_two_ranks_read_again_only_the_changed_files_and_agree() -> None:
    """The stats are taken and the changed entries read over both ranks; every rank ends
    with the same tables, equal to a fresh build's."""
    import shutil
    import tempfile

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert world.size == 2
    root = Path(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None))
    if world.rank == 0:
        write_universes(root, 8, 5, "channels-last", "int16", val_files=2)
    world.Barrier()
    open_manifest(root, 4, world, means=True)
    if world.rank == 0:
        for i in (1, 3):  # one changed file for each rank's share, and one not
            rewrite(root / f"train/universe_{i:03d}.hdf5",
                    np.full(4, 0.1 * i, np.float32), float(i), layout="channels-last",
                    dtype="int16")
    world.Barrier()
    probed: list[str] = []
    probe = formats.probe

    def counted(path: Path, *args: object, **kw: object) -> object:
        probed.append(Path(path).name)
        return probe(path, *args, **kw)
    formats.probe = counted
    try:
        changed = open_manifest(root, 4, world, means=True)
    finally:
        formats.probe = probe
    assert sorted(sum(world.allgather(probed), [])) == ["universe_001.hdf5",
                                                        "universe_003.hdf5"]
    assert len(probed) == 1  # shared out: one each
    if world.rank == 0:
        fresh = root.parent / (root.name + "-fresh")
        shutil.copytree(root, fresh, ignore=shutil.ignore_patterns("cosmotrain-*"))
    world.Barrier()
    rebuilt = open_manifest(Path(str(root) + "-fresh"), 4, world, means=True)
    for split in ("train", "validation"):
        np.testing.assert_array_equal(changed.labels[split], rebuilt.labels[split])
        np.testing.assert_array_equal(changed.means[split], rebuilt.means[split])
    for other in world.allgather(changed.labels["train"]):
        np.testing.assert_array_equal(other, changed.labels["train"])
    np.testing.assert_array_equal(changed.labels["train"][3], np.full(4, 0.3, np.float32))
