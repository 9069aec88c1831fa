"""Write failures: a full, read-only or failing disk is a one-line WriteError (exit 2), never
a crash, a traceback, a ``.tmp`` leftover, a torn line or a lost earlier checkpoint.

Two kinds of test:

- on a real small filesystem (a 512 KiB tmpfs, or a read-only one) mounted by the
  ``small_fs`` fixture: needs root and ``mount`` (CI runs as root); skipped with the reason
  elsewhere;
- with a fault injected in-process (``os.write`` / ``os.fsync`` / ``os.open`` raising
  ``OSError``): the same logic, on every platform.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, subprocess_env
from test_checkpoint import assert_same, make_state
from test_metrics import train

from cosmotrain.files import atomic
from cosmotrain.files.atomic import (PROBE_NAME, check_writable, write_bytes_atomically,
                                      write_text_atomically)
from cosmotrain.config import load_config, save_resolved
from cosmotrain.errors import UserError, WriteError
from cosmotrain.train import predict
from cosmotrain.train.checkpoints.checkpoint import (checkpoint_name, list_checkpoints,
                                                      load_checkpoint, newest_intact_checkpoint,
                                                      save_checkpoint)
from cosmotrain.train.outputs.metrics import MetricsLog, read_metrics

ENOSPC = "No space left on device"
EROFS = "Read-only file system"


# --- a real small filesystem --------------------------------------------------------------

def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``small_fs(size="512k", readonly=False) -> Path``: a fresh tmpfs mounted under
    ``tmp_path``, unmounted at teardown.  Skips when mounting is not permitted."""
    mounted: list[Path] = []

    def mount(size: str = "512k", readonly: bool = False) -> Path:
        if not sys.platform.startswith("linux"):
            pytest.skip("a tmpfs mount needs Linux; the in-process fault tests cover this")
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small tmpfs needs root and mount(8); the in-process "
                        "fault tests cover the same logic")
        target = tmp_path / f"fs{len(mounted)}"
        target.mkdir()
        options = f"size={size}" + (",ro" if readonly else "")
        done = _run("mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target))
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})"
                        f"; the in-process fault tests cover the same logic")
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        if _run("umount", str(target)).returncode != 0:
            _run("umount", "-l", str(target))


def remount_read_only(target: Path) -> None:
    done = _run("mount", "-o", "remount,ro", str(target))
    assert done.returncode == 0, done.stderr


def fill(folder: Path, leave: int = 0) -> Path:
    """Write a filler file until the filesystem is full, then free ``leave`` bytes."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    if leave:
        os.truncate(filler, filler.stat().st_size - leave)
    return filler


def big_state(step: int, mib: float) -> object:
    state = make_state(step)
    state.params["big.weight"] = np.ones(int(mib * 2**18), np.float32)
    return state


@pytest.mark.parametrize("size, leave", [("small", 0), ("small", 4096), ("small", 8192),
                                         ("large", 0)])
def test_checkpoint_onto_a_full_filesystem(small_fs: Callable[..., Path], size: str,
                                           leave: int) -> None:
    """A small checkpoint meeting ENOSPC with 4 or 8 KiB free used to segfault in h5py's
    flush (exit 139, killing this test process) and leave its .tmp; a large one was a
    traceback.  Now all are a WriteError, no .tmp is left, and the earlier checkpoints
    still load and verify."""
    folder = small_fs("512k")
    earlier = [save_checkpoint(folder, make_state(step), keep_last=2) for step in (1, 2)]
    if size == "small":
        fill(folder, leave)
        state = make_state(3)
    else:
        state = big_state(3, mib=1.0)  # twice the whole filesystem
    with pytest.raises(WriteError) as info:
        save_checkpoint(folder, state, keep_last=2)
    final = folder / checkpoint_name(3)
    assert str(info.value) == (f"cannot write '{final}': {ENOSPC}; free space or choose "
                               f"another output.dir")
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())
    assert [p for _, p in list_checkpoints(folder)] == earlier
    for step, path in zip((1, 2), earlier):
        assert_same(make_state(step), load_checkpoint(path))
    assert newest_intact_checkpoint(folder).path == earlier[-1]


def test_checkpoint_cli_exit_code_on_a_full_filesystem(small_fs: Callable[..., Path]) -> None:
    """The whole path through a process: exit 2 and one line, not signal 11."""
    folder = small_fs("512k")
    save_checkpoint(folder, make_state(1))
    fill(folder)
    script = ("import sys; sys.path.insert(0, 'tests')\n"
              "from test_checkpoint import make_state\n"
              "from cosmotrain.errors import UserError\n"
              "from cosmotrain.train.checkpoints.checkpoint import save_checkpoint\n"
              "try:\n"
              f"    save_checkpoint({str(folder)!r}, make_state(2))\n"
              "except UserError as err:\n"
              "    print(err, file=sys.stderr); sys.exit(2)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.strip().count("\n") == 0 and ENOSPC in done.stderr


def test_metrics_onto_a_full_filesystem_leaves_no_torn_line(
        small_fs: Callable[..., Path]) -> None:
    """Records fill the last page of the file until one crosses it: that write is short,
    then ENOSPC: the file is cut back to its last complete line."""
    folder = small_fs("512k")
    path = folder / "metrics.jsonl"
    log = MetricsLog(path)
    log.write(train(1))
    fill(folder)
    written = 1
    with pytest.raises(WriteError, match=f"cannot write '{path}': {ENOSPC}"):
        for step in range(2, 1000):
            log.write(train(step))
            written += 1
    assert 1 < written < 999                       # some fitted in the page, then one did not
    text = path.read_text()
    assert text.endswith("\n")
    assert [r["step"] for r in read_metrics(path)] == list(range(1, written + 1))
    (folder / "filler").unlink()                   # space again: the log carries on
    log.write(train(written + 1))
    log.close()
    assert [r["step"] for r in read_metrics(path)][-1] == written + 1


def test_check_writable_on_a_read_only_mount(small_fs: Callable[..., Path]) -> None:
    folder = small_fs("64k", readonly=True)
    with pytest.raises(WriteError) as info:
        check_writable(folder)
    assert str(info.value) == (f"cannot write '{folder}': {EROFS}; the filesystem is "
                               f"read-only: choose another output.dir")
    with pytest.raises(WriteError, match=EROFS):
        check_writable(folder / "run" / "checkpoints")          # cannot even create it
    with pytest.raises(WriteError, match=EROFS):
        save_resolved(load_config(None, []), folder)


def test_check_writable_on_a_full_filesystem(small_fs: Callable[..., Path]) -> None:
    folder = small_fs("512k")
    assert check_writable(folder / "run") == folder / "run"
    fill(folder)
    with pytest.raises(WriteError, match=f"{ENOSPC}; free space"):
        check_writable(folder / "run")
    assert sorted(p.name for p in folder.iterdir()) == ["filler", "run"]
    assert list((folder / "run").iterdir()) == []                  # the probe is gone


def test_datagen_and_staging_onto_a_full_filesystem(small_fs: Callable[..., Path],
                                                   tmp_path: Path) -> None:
    """Samples, copies and caches go through the atomic writer: a small sample meeting
    ENOSPC in h5py's flush used to segfault; now each is one line naming the file, with
    no temporary file left."""
    from cosmotrain.data.synthetic import datagen
    from cosmotrain.data.copies import stage as staging

    folder = small_fs("512k")
    for leave in (0, 4096, 8192, 12288):
        fill(folder, leave)
        with pytest.raises(UserError) as info:
            datagen.generate_dataset(folder / "data", 2, 12, 0, overwrite=True)
        assert str(info.value) == (f"cannot write '{folder / 'data/train/sample_000000.hdf5'}"
                                   f"': {ENOSPC}; free space or choose another --out")
        assert not list(folder.rglob("*.tmp")) and not list(folder.rglob(".*"))
        (folder / "filler").unlink()
    source = datagen.generate_dataset(tmp_path / "data", 1, 64, 0)  # 2 MiB per sample
    sample = tmp_path / "data" / source["splits"]["train"]["files"][0]
    with pytest.raises(WriteError) as info:
        staging.copy_verified(sample, folder / "stage/sample.hdf5")
    assert str(info.value) == (f"cannot write '{folder / 'stage/sample.hdf5'}': {ENOSPC}; "
                               f"free space or choose another --dest")
    assert list((folder / "stage").iterdir()) == []


def test_checkpoints_survive_a_remount_read_only(small_fs: Callable[..., Path]) -> None:
    folder = small_fs("512k")
    first = save_checkpoint(folder, make_state(1))
    config = save_resolved(load_config(None, []), folder)
    before = config.read_bytes()
    remount_read_only(folder)
    with pytest.raises(WriteError, match=EROFS):
        save_checkpoint(folder, make_state(2), keep_last=1)
    with pytest.raises(WriteError, match=EROFS):
        save_resolved(load_config(None, ["train.batch_size=8"]), folder)
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_step0000001.h5", "config.yaml"]
    assert config.read_bytes() == before
    assert_same(make_state(1), load_checkpoint(first))


def test_predict_into_a_read_only_directory_fails_before_computing(
        small_fs: Callable[..., Path], tmp_path: Path) -> None:
    """The checkpoint and data do not even exist: --out is refused first, in well under
    the time loading and predicting would take."""
    folder = small_fs("64k", readonly=True)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cosmotrain", "predict", "--checkpoint",
         str(tmp_path / "missing.h5"), "--data", str(tmp_path / "no-data"), "--out",
         str(folder / "preds.h5")], cwd=REPO, env=subprocess_env(), capture_output=True,
        text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"cosmotrain: error: cannot write '{folder}': {EROFS}; "
                                   f"the filesystem is read-only: choose another --out")
    assert "Traceback" not in done.stderr and time.perf_counter() - started < 60


def test_train_into_a_read_only_output_dir_exits_2(small_fs: Callable[..., Path]) -> None:
    folder = small_fs("64k", readonly=True)
    sets = ["model.name=tiny", "data.source=synthetic", "data.synthetic.samples=8",
            "train.batch_size=4", "train.epochs=1", f"output.dir={folder / 'run'}"]
    done = subprocess.run(
        [sys.executable, "-m", "cosmotrain", "train",
         *[arg for item in sets for arg in ("--set", item)]],
        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"cosmotrain: error: cannot write '{folder / 'run'}': "
                                   f"{EROFS}; the filesystem is read-only: choose another "
                                   f"output.dir")


# --- faults injected in-process (every platform) ------------------------------------------

@pytest.fixture
def disk_full_after(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``disk_full_after(n)``: os.write accepts ``n`` more bytes (the last call short), then
    raises ENOSPC, as a filling disk does."""
    real = os.write

    def arm(room: int) -> None:
        left = [room]

        def write(fd: int, data: bytes) -> int:
            if left[0] <= 0:
                raise OSError(errno.ENOSPC, ENOSPC)
            count = real(fd, memoryview(data)[:left[0]])
            left[0] -= count
            return count
        monkeypatch.setattr(os, "write", write)
    return arm


@pytest.mark.parametrize("room", [0, 1000])
def test_injected_enospc_in_a_checkpoint(tmp_path: Path, disk_full_after,
                                         room: int) -> None:
    first = save_checkpoint(tmp_path, make_state(1), keep_last=1)
    before = first.read_bytes()
    disk_full_after(room)
    with pytest.raises(WriteError, match=f"ckpt_step0000002.h5': {ENOSPC}; free space"):
        save_checkpoint(tmp_path, make_state(2), keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert first.read_bytes() == before


def test_injected_fsync_and_rename_failures(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.txt"
    write_text_atomically(target, "old\n")

    def eio(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")
    for name in ("fsync", "replace"):
        with monkeypatch.context() as patch:
            patch.setattr(atomic.os, name, eio)
            with pytest.raises(WriteError, match="Input/output error; check the disk"):
                write_text_atomically(target, "new\n")
        assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
        assert target.read_text() == "old\n"


def test_unique_temporary_names_keep_concurrent_writers_apart(tmp_path: Path) -> None:
    """Two processes writing one file (two nodes' leaders, two jobs caching one dataset):
    with ``unique`` each fills a hidden temporary file of its own, so neither clobbers
    or removes the other's, and the last rename wins."""
    final = tmp_path / "manifest.json"
    assert atomic.temporary_path(final) == tmp_path / "manifest.json.tmp"
    names = {atomic.temporary_path(final, unique=True).name for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith(f".manifest.json.{os.getpid()}.") and n.endswith(".tmp")
               for n in names)
    seen = []

    def slow(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("first\n")
        write_text_atomically(final, "second\n", unique=True)  # another writer meanwhile
        assert final.read_text() == "second\n" and tmp.read_text() == "first\n"
    atomic.write_atomically(final, slow, unique=True)
    assert final.read_text() == "first\n"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".manifest.json.")

    def clobbered(tmp: Path) -> None:  # without unique, the second writer takes the name
        tmp.write_text("first\n")
        write_text_atomically(final, "third\n")
    with pytest.raises(WriteError, match="No such file or directory"):
        atomic.write_atomically(final, clobbered)
    assert final.read_text() == "third\n"


def test_a_bug_in_the_writer_is_not_a_write_error(tmp_path: Path) -> None:
    def buggy(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError, match="bug"):
        atomic.write_atomically(tmp_path / "x", buggy)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("room", [0, 10, 300])
def test_injected_enospc_in_metrics_cuts_back_to_the_last_line(
        tmp_path: Path, disk_full_after, room: int) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        log.write(train(1))
        before = path.read_bytes()
        disk_full_after(room)                  # each record is ~450 bytes: always short
        with pytest.raises(WriteError, match=f"metrics.jsonl': {ENOSPC}"):
            log.write(train(2))
        assert path.read_bytes() == before
        disk_full_after(10**6)
        log.write(train(3))
    assert [r["step"] for r in read_metrics(path)] == [1, 3]


def test_check_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    created = check_writable(tmp_path / "a" / "b")
    assert created.is_dir() and list(created.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(WriteError, match="it is a file, not a directory"):
        check_writable(tmp_path / "file")
    with pytest.raises(WriteError, match="Not a directory"):
        check_writable(tmp_path / "file" / "sub")
    real = os.open

    def read_only(path: object, *args: object, **kwargs: object) -> int:
        if PROBE_NAME in str(path):
            raise OSError(errno.EROFS, EROFS)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(WriteError) as info:
        check_writable(tmp_path, where="--out")
    assert str(info.value) == (f"cannot write '{tmp_path}': {EROFS}; the filesystem is "
                               f"read-only: choose another --out")
    assert isinstance(info.value, UserError) and not info.value.collective


def test_write_error_messages() -> None:
    cases = {errno.ENOSPC: "free space or choose another output.dir",
             errno.EDQUOT: "free space or choose another output.dir",
             errno.EACCES: "check its permissions or choose another output.dir",
             errno.EIO: "check the disk or choose another output.dir"}
    for code, fix in cases.items():
        err = WriteError("/x/y", OSError(code, os.strerror(code), "/x/y.tmp"))
        assert str(err) == f"cannot write '/x/y': {os.strerror(code)}; {fix}"
        assert err.errno == code and err.path == "/x/y"
    assert str(WriteError("/x", OSError("odd"))) == \
        "cannot write '/x': odd; check the disk or choose another output.dir"


def test_files_are_written_with_mode_0644(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        text = write_text_atomically(tmp_path / "a.txt", "a")
        raw = write_bytes_atomically(tmp_path / "b.bin", b"\x00\x01")
        config = save_resolved(load_config(None, []), tmp_path / "run")
        ckpt = save_checkpoint(tmp_path / "ck", make_state())
    finally:
        os.umask(old)
    for path in (text, raw, config, ckpt):
        assert path.stat().st_mode & 0o777 == 0o644, path
    assert raw.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in config.parent.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("probe", [True, False], ids=["probe-fails", "write-fails"])
def test_save_resolved_leaves_no_tmp_and_keeps_the_old_file(
        tmp_path: Path, disk_full_after, monkeypatch: pytest.MonkeyPatch, probe: bool) -> None:
    path = save_resolved(load_config(None, ["train.batch_size=12"]), tmp_path)
    before = path.read_text()
    if not probe:  # the directory probe passes, the config's own write fails
        monkeypatch.setattr(atomic, "check_writable", lambda folder, *args: Path(folder))
    disk_full_after(0)
    failing = tmp_path if probe else path
    with pytest.raises(WriteError, match=f"cannot write '{failing}': {ENOSPC}"):
        save_resolved(load_config(None, ["train.batch_size=8"]), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
    assert path.read_text() == before


def test_predict_refuses_an_unwritable_out_before_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, one rank: run_prediction refuses --out before the checkpoint is read."""
    from mpi4py import MPI

    def must_not_load(path: object) -> None:
        raise AssertionError("the checkpoint was loaded before --out was checked")
    monkeypatch.setattr(predict, "load_checkpoint", must_not_load)
    with pytest.raises(UserError, match="is a directory; name an HDF5 file"):
        predict.run_prediction(tmp_path / "c.h5", tmp_path, tmp_path, MPI.COMM_WORLD)
    (tmp_path / "file").write_text("x")
    with pytest.raises(WriteError, match="it is a file, not a directory; check the disk or "
                       "choose another --out") as info:
        predict.run_prediction(tmp_path / "c.h5", tmp_path, tmp_path / "file" / "p.h5",
                               MPI.COMM_WORLD)
    assert info.value.collective                          # every rank raises it alike


def test_predictions_onto_a_full_disk(tmp_path: Path, disk_full_after,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    result = predict.SplitPredictions(
        "validation", np.ones((3, 4), np.float32), np.zeros((3, 4), np.float32),
        ["a.hdf5", "b.hdf5", "c.hdf5"], np.zeros(3, np.int32))
    cfg = load_config(None, ["data.source=files", f"data.path={tmp_path}"])
    out = tmp_path / "preds.h5"
    predict.write_predictions(out, {"validation": result}, make_state(), tmp_path / "c.h5",
                              cfg)
    before = out.read_bytes()
    monkeypatch.setattr(atomic, "check_writable", lambda folder, **kw: Path(folder))
    monkeypatch.setattr(predict, "check_writable", lambda folder, **kw: Path(folder))
    disk_full_after(2000)
    with pytest.raises(WriteError, match=f"preds.h5': {ENOSPC}; free space or choose "
                                         f"another --out"):
        predict.write_predictions(out, {"validation": result}, make_state(8),
                                  tmp_path / "c.h5", cfg, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["preds.h5"]
    assert out.read_bytes() == before
