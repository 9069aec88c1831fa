"""`cosmotrain preload`: staging copies what the nodes read, verifies it, writes the manifest;
the staged copy serves the same batches; local shuffle stages only a node's shards; bad
files and bad copies are named."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import mpiexec, subprocess_env
from test_data_manifest import write_universes

from cosmotrain.config.load import load_config
from cosmotrain.data.dataset import file_sums
from cosmotrain.data.copies import stage as staging
from cosmotrain.data.dataset.manifest import open_manifest
from cosmotrain.data.readers.job_readers import make_reader, open_dataset
from cosmotrain.data.readers.placement import BlockPlacement
from cosmotrain.errors import DataError

ARGS = ["--set", "model.width=4", "--set", "train.batch_size=6"]


def first_batch(path: Path) -> np.ndarray:
    cfg = load_config(None, [f"data.path={path}", "model.width=4", "train.batch_size=6"])
    from mpi4py import MPI

    reader = make_reader(cfg, open_dataset(cfg, MPI.COMM_SELF), "train", MPI.COMM_SELF,
                         BlockPlacement((1,) * 5, (0,) * 5, 4, 4))
    batch = reader.batch(0, 0)
    reader.close()
    return batch.x.data


def test_staged_copy_is_identical_and_serves_the_same_batches(cli, tmp_path: Path) -> None:
    source = tmp_path / "universes"
    write_universes(source, 8, 3, "channels-first", "int16")
    code, out, err = cli("preload", "--set", f"data.path={source}", *ARGS,
                         "--dest", str(tmp_path / "stage"))
    assert code == 0, err
    assert "staged 4 file(s)" in out and "GiB/s" in out and "checksums verified" in out
    for path in source.glob("*/*.hdf5"):
        assert (tmp_path / "stage" / path.relative_to(source)).read_bytes() == path.read_bytes()
    staged = open_manifest(tmp_path / "stage", 4)
    assert staged.source == tmp_path / "stage" / "manifest.json"
    assert staged.files == open_manifest(source, 4).files
    np.testing.assert_array_equal(first_batch(tmp_path / "stage"), first_batch(source))
    code, out, _ = cli("preload", "--set", f"data.path={source}", *ARGS,
                       "--dest", str(tmp_path / "stage"))
    assert code == 0 and "0.0 MiB copied" in out  # verified copies are kept


def test_default_destination_is_under_tmpdir(cli, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    write_universes(tmp_path / "mydata", 4, 1, "channels-last", "int16", val_files=0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    code, out, err = cli("preload", "--set", f"data.path={tmp_path / 'mydata'}", *ARGS)
    assert code == 0, err
    assert (tmp_path / "tmp/cosmotrain/mydata/manifest.json").is_file()
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'mydata'}", *ARGS,
                       "--dest", str(tmp_path / "mydata"))
    assert code == 2 and "is the dataset itself" in err


def test_a_dest_holding_another_dataset_is_refused(cli, tmp_path: Path) -> None:
    """Same directory name, same file names, other data: nothing of the first copy is
    replaced; the same dataset re-stages; an empty or older staging directory is taken."""
    for name, seed in (("a", 0), ("b", 1)):
        write_universes(tmp_path / name / "data", 4, 2, "channels-last", "int16", seed=seed)
    stage = tmp_path / "stage"
    args = [*ARGS, "--dest", str(stage)]
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'a/data'}", *args)
    assert code == 0, err
    before = {p: p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    code, out, err = cli("preload", "--set", f"data.path={tmp_path / 'b/data'}", *args)
    assert code == 2 and not out
    assert err.count(f"--dest '{stage}' holds a staging of '{tmp_path / 'a/data'}'") == 1
    assert "choose another --dest, or remove that directory first" in err
    assert {p: p.read_bytes() for p in stage.rglob("*") if p.is_file()} == before
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'a/data'}", *args)
    assert code == 0, err
    (stage / ".cosmotrain-stage.json").unlink()  # a staging by an older cosmotrain
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'a/data'}", *args)
    assert code == 0, err
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("mine")
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'a/data'}", *ARGS,
                       "--dest", str(tmp_path / "other"))
    assert code == 2 and "holds files that are not a staging of it" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'a/data'}", *ARGS,
                       "--dest", str(tmp_path / "empty"))
    assert code == 0, err


def test_the_first_record_wins_over_a_concurrent_staging(tmp_path: Path) -> None:
    """Another job recorded its dataset in the empty --dest after this one checked it:
    this staging is refused before its first copy, and the record stays the other's."""
    from mpi4py import MPI

    from cosmotrain.data.copies.stage_claim import record_source, recorded_source
    from cosmotrain.errors import UserError

    write_universes(tmp_path / "data", 4, 2, "channels-last", "int16", val_files=0)
    cfg = load_config(None, [f"data.path={tmp_path / 'data'}", "model.width=4",
                             "train.batch_size=2"])
    plan = staging.plan_staging(cfg, MPI.COMM_SELF, tmp_path / "stage")
    record_source(tmp_path / "stage", tmp_path / "other")  # the concurrent job, first
    with pytest.raises(UserError, match=f"holds a staging of '{tmp_path / 'other'}'"):
        staging.run_staging(plan, MPI.COMM_SELF)
    assert recorded_source(tmp_path / "stage") == str(tmp_path / "other")
    assert [p.name for p in (tmp_path / "stage").iterdir()] == [".cosmotrain-stage.json"]
    record_source(tmp_path / "stage", tmp_path / "other")  # the same source: accepted


def test_without_hard_links_a_record_is_still_never_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from cosmotrain.data.copies.stage_claim import record_source, recorded_source
    from cosmotrain.errors import UserError

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    record_source(tmp_path / "stage", tmp_path / "first")
    with pytest.raises(UserError, match=f"holds a staging of '{tmp_path / 'first'}'"):
        record_source(tmp_path / "stage", tmp_path / "second")
    assert recorded_source(tmp_path / "stage") == str(tmp_path / "first")
    assert [p.name for p in (tmp_path / "stage").iterdir()] == [".cosmotrain-stage.json"]


def test_local_shuffle_stages_the_shards_of_the_nodes_groups(tmp_path: Path) -> None:
    write_universes(tmp_path, 8, 3, "channels-last", "int16", val_files=2)
    manifest = open_manifest(tmp_path, 4)  # 24 train samples, 8 per file; 16 validation
    train = list(manifest.files["train"])
    val = list(manifest.files["validation"])
    # batches of 6 over 2 groups: shards [0, 12) and [12, 24) -> files {0, 1} and {1, 2}
    assert staging.node_files(manifest, 6, 2, {0}, "local") == train[:2] + val[:1]
    assert staging.node_files(manifest, 6, 2, {1}, "local") == train[1:] + val[1:]
    assert staging.node_files(manifest, 6, 2, {0, 1}, "local") == train + val
    assert staging.node_files(manifest, 6, 2, {1}, "global") == train + val


def test_a_bad_copy_and_a_bad_source_are_named(cli, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    write_universes(tmp_path / "data", 4, 2, "channels-last", "int16", val_files=0)
    source = tmp_path / "data/train/universe_000.hdf5"
    def bad_copy(src: Path, dst: Path) -> int:
        dst.write_bytes(b"x")
        return 0  # not the checksum of what was written: the copy went wrong

    monkeypatch.setattr(staging, "_copy", bad_copy)
    with pytest.raises(DataError, match="does not match the source's checksum"):
        staging.copy_verified(source, tmp_path / "stage/universe_000.hdf5")
    monkeypatch.undo()
    missing = tmp_path / "data/train/universe_009.hdf5"  # a source that cannot be read
    with pytest.raises(DataError, match=f"data file '{missing}': cannot be staged to"):
        staging.copy_verified(missing, tmp_path / "stage/universe_009.hdf5")
    assert list((tmp_path / "stage").iterdir()) == []  # no copy, no temporary file
    source.write_bytes(source.read_bytes()[:100])
    code, _, err = cli("preload", "--set", f"data.path={tmp_path / 'data'}", *ARGS,
                       "--dest", str(tmp_path / "stage"))
    assert code == 2 and f"data file '{source}'" in err


def test_two_ranks_stage_with_local_shuffle(tmp_path: Path) -> None:
    write_universes(tmp_path / "data", 4, 4, "channels-last", "float32")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain", "preload",
           "--set", f"data.path={tmp_path / 'data'}", "--set", "model.width=4",
           "--set", "train.batch_size=2", "--shuffle", "local",
           "--dest", str(tmp_path / "stage")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert "staged 5 file(s)" in out.stdout and "on 1 node(s) (local shuffle)" in out.stdout
    assert sorted(p.name for p in (tmp_path / "stage/train").iterdir()) == [
        f"universe_{i:03d}.hdf5" for i in range(4)]
    recorded = json.loads((tmp_path / "stage/manifest.json").read_text())["checksums"]
    assert recorded["algorithm"] == "crc32c"  # both ranks' copies, gathered by the leader
    assert {name: tuple(s) for name, s in recorded["files"].items()} == file_sums.sum_files(
        tmp_path / "stage", [f"{split}/universe_{i:03d}.hdf5" for split, n in
                             (("train", 4), ("validation", 1)) for i in range(n)])



def test_reader_io_counters(tmp_path: Path) -> None:
    from mpi4py import MPI

    write_universes(tmp_path, 4, 3, "channels-last", "int16", val_files=0)  # 3 samples
    sample_bytes = 4 * 4 ** 3 * 2
    whole = BlockPlacement((1,) * 5, (0,) * 5, 4, 4)
    readers = {}
    for kind in ("direct", "preload"):
        cfg = load_config(None, [f"data.path={tmp_path}", "model.width=4",
                                 "train.batch_size=2", f"data.reader={kind}",
                                 "data.prefetch=false"])
        readers[kind] = make_reader(cfg, open_dataset(cfg, MPI.COMM_SELF), "train",
                                    MPI.COMM_SELF, whole)
        list(readers[kind].epoch(0))
    direct, preload = readers["direct"].stats, readers["preload"].stats
    assert direct.batches == 2 and direct.bytes_read == 3 * sample_bytes
    assert direct.last_bytes_read == sample_bytes and direct.read_seconds > 0
    assert direct.wait_seconds >= direct.last_wait_seconds > 0
    assert preload.load_bytes == 3 * sample_bytes and preload.bytes_read == 0
    assert preload.bytes_received == 0  # one rank: every block is its own
    preload.reset()
    assert preload.batches == 0 and preload.wait_seconds == 0
    assert preload.load_bytes == 3 * sample_bytes  # the pass is kept
    assert set(direct.as_dict()) >= {"wait_seconds", "bytes_read", "bytes_received"}
    for reader in readers.values():
        reader.close()
    with pytest.raises(ValueError, match="do not hold every block"):
        make_reader(cfg, open_dataset(cfg, MPI.COMM_SELF), "train", MPI.COMM_SELF,
                    BlockPlacement((1, 1, 2, 1, 1), (0, 0, 1, 0, 0), 4, 4))


def test_copies_go_through_temporary_names_of_their_own(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Nodes staging onto one shared directory copy the same file at once: each copy is
    made under a hidden name of its process's own, so none overwrites another's."""
    write_universes(tmp_path / "data", 4, 1, "channels-last", "int16", val_files=0)
    source = tmp_path / "data/train/universe_000.hdf5"
    target = tmp_path / "stage/universe_000.hdf5"
    real, seen = staging._copy, []

    def copy(src: Path, dst: Path) -> int:
        seen.append(dst)
        if len(seen) == 1:  # another node copies the same file meanwhile
            assert staging.copy_verified(src, target) == source.stat().st_size
        return real(src, dst)
    monkeypatch.setattr(staging, "_copy", copy)
    assert staging.copy_verified(source, target) == source.stat().st_size
    assert len(seen) == 2 and seen[0] != seen[1]
    assert all(p.parent == target.parent and p.name.startswith(f".{target.name}.")
               and p.name.endswith(".tmp") for p in seen)
    assert target.read_bytes() == source.read_bytes()
    assert [p.name for p in target.parent.iterdir()] == [target.name]
