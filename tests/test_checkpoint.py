"""HDF5 checkpoints: round trip of every field, atomic writes under interruption, retention,
checksums (a damaged array is named, the newest intact checkpoint is found, version 1 still
loads), clear errors for damaged files, and loading into the torch.nn twin of the tiny model.

Disk-full and read-only filesystems are in test_write_failures.py."""

from __future__ import annotations

import errno
import shutil
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import latest_checkpoint
from cosmotrain.files import atomic
from cosmotrain.config.schema import ModelConfig
from cosmotrain.errors import DataError, WriteError
from cosmotrain.models import build_model
from cosmotrain.train.checkpoints import checkpoint as ck
from cosmotrain.train.checkpoints.checkpoint import (CheckpointState, DamagedCheckpoint,
                                                      checkpoint_dir, checkpoint_name,
                                                      list_checkpoints,
                                                      load_checkpoint, newest_intact_checkpoint,
                                                      save_checkpoint)
from cosmotrain.engine.optim import Adam

CONFIG = "model:\n  name: tiny  # ünïcode survives\ntrain:\n  batch_size: 4\n"


def make_state(step: int = 7, seed: int = 0) -> CheckpointState:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(4, 2, 3, 3, 3)).astype(np.float32)
    b = rng.normal(size=(4,)).astype(np.float32)
    return CheckpointState(
        step=step, epoch=2, samples_seen=step * 4,
        params={"conv1.weight": w, "fc.bias": b},
        buffers={"bn1.running_mean": np.zeros(4, np.float32),
                 "bn1.running_var": np.ones(4, np.float32),
                 "bn1.num_batches_tracked": np.int64(step)},
        optimizer={"conv1.weight": {"step": step, "exp_avg": w * 0.1, "exp_avg_sq": w * w},
                   "fc.bias": {"momentum_buffer": b * 2}},
        optimizer_scalars={"name": "adam", "lr": 1e-3},
        config_yaml=CONFIG,
        rng={"seed": 1234, "epoch": 2, "shuffled": True},
        layout={"ranks": 4, "sample": 2, "depth": 2, "spatial_until": "fc1"})


def assert_same(a: CheckpointState, b: CheckpointState) -> None:
    assert (a.step, a.epoch, a.samples_seen, a.format_version) == \
        (b.step, b.epoch, b.samples_seen, b.format_version)
    assert a.config_yaml == b.config_yaml
    for mine, theirs in ((a.params, b.params), (a.buffers, b.buffers)):
        assert list(mine) == list(theirs)
        for name in mine:
            assert np.asarray(mine[name]).dtype == np.asarray(theirs[name]).dtype
            assert np.array_equal(mine[name], theirs[name])
    assert list(a.optimizer) == list(b.optimizer)
    for name, slots in a.optimizer.items():
        assert sorted(slots) == sorted(b.optimizer[name])
        for key, value in slots.items():
            assert type(value) is type(b.optimizer[name][key])
            assert np.array_equal(value, b.optimizer[name][key])
    for mine, theirs in ((a.optimizer_scalars, b.optimizer_scalars), (a.rng, b.rng),
                         (a.layout, b.layout)):
        assert mine == theirs
        assert [type(v) for v in mine.values()] == [type(theirs[k]) for k in mine]


def test_round_trip_of_every_field(tmp_path: Path) -> None:
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    assert path == tmp_path / "ckpt_step0000007.h5"
    loaded = load_checkpoint(path)
    assert_same(state, loaded)
    assert isinstance(loaded.optimizer["conv1.weight"]["step"], int)       # not np.int64
    assert isinstance(loaded.buffers["bn1.num_batches_tracked"], np.int64)


def test_file_layout_is_plain_hdf5(tmp_path: Path) -> None:
    """Other tools (h5py, h5dump) find the documented groups and names."""
    with h5py.File(save_checkpoint(tmp_path, make_state()), "r") as f:
        assert f.attrs["format"] == ck.FORMAT and f.attrs["step"] == 7
        assert f["params/conv1.weight"].shape == (4, 2, 3, 3, 3)
        assert f["params/conv1.weight"].dtype == np.float32
        assert f["optimizer/conv1.weight/exp_avg"].shape == (4, 2, 3, 3, 3)
        assert f["optimizer/conv1.weight"].attrs["step"] == 7
        assert f["rng"].attrs["seed"] == 1234
        assert f["config"].asstr()[()] == CONFIG


def test_names_and_latest(tmp_path: Path) -> None:
    assert checkpoint_name(123) == "ckpt_step0000123.h5"
    assert checkpoint_dir("runs/x") == Path("runs/x/checkpoints")
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for step in (9_999_999, 10_000_000, 5):          # numeric, not lexical, order
        save_checkpoint(tmp_path, make_state(step))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(tmp_path) == tmp_path / "ckpt_step10000000.h5"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 9_999_999, 10_000_000]


def _fail_midway(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Make the writer die after the parameters are written, as a crash would."""
    def boom(group: h5py.Group, slots: object) -> None:
        raise error
    monkeypatch.setattr(ck, "_write_slots", boom)


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_write_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    first = save_checkpoint(tmp_path, make_state(100), keep_last=1)
    before = first.read_bytes()
    _fail_midway(monkeypatch, error)
    with pytest.raises(type(error)):
        save_checkpoint(tmp_path, make_state(200, seed=1), keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]      # no .tmp left
    assert first.read_bytes() == before
    assert latest_checkpoint(tmp_path) == first
    assert_same(make_state(100), load_checkpoint(first))


def test_failed_rename_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = save_checkpoint(tmp_path, make_state(100), keep_last=1)

    def no_rename(src: object, dst: object) -> None:
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(atomic.os, "replace", no_rename)
    with pytest.raises(WriteError, match=r"cannot write '.*ckpt_step0000200.h5': Input/outp"):
        save_checkpoint(tmp_path, make_state(200), keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert_same(make_state(100), load_checkpoint(first))


def test_failed_rewrite_of_the_same_step_keeps_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = save_checkpoint(tmp_path, make_state(100))
    _fail_midway(monkeypatch, RuntimeError("crash"))
    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, make_state(100, seed=5))
    assert_same(make_state(100), load_checkpoint(first))


def test_truncated_tmp_leftover_is_ignored_then_removed(tmp_path: Path) -> None:
    """A job killed mid-write leaves ckpt_...h5.tmp; resume must use the last good file."""
    good = save_checkpoint(tmp_path, make_state(100))
    leftover = tmp_path / (checkpoint_name(200) + ".tmp")
    data = good.read_bytes()
    leftover.write_bytes(data[: len(data) // 2])
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(DataError, match=leftover.name):
        load_checkpoint(leftover)
    third = save_checkpoint(tmp_path, make_state(300))
    assert not leftover.exists()
    assert [p for _, p in list_checkpoints(tmp_path)] == [good, third]


def test_retention_keeps_exactly_the_last_k(tmp_path: Path) -> None:
    for step in range(1, 7):
        save_checkpoint(tmp_path, make_state(step), keep_last=3)
        assert len(list_checkpoints(tmp_path)) == min(step, 3)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5, 6]
    save_checkpoint(tmp_path, make_state(7), keep_last=None)                 # keep all
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5, 6, 7]
    save_checkpoint(tmp_path, make_state(8), keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [8]


def test_retention_never_deletes_the_file_just_written(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(200))
    written = save_checkpoint(tmp_path, make_state(100), keep_last=1)
    assert written.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [100, 200]
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, make_state(300), keep_last=0)
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, make_state(-1))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_checkpoint_is_a_data_error_naming_the_file(tmp_path: Path,
                                                            damage: str) -> None:
    path = save_checkpoint(tmp_path, make_state())
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) * 2 // 3], "garbage": b"\x00junk" * 99,
                      "empty": b""}[damage])
    with pytest.raises(DamagedCheckpoint) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint '{path}'") and "; " in message
    assert "\n" not in message


def test_partial_or_foreign_files_are_data_errors(tmp_path: Path) -> None:
    foreign = tmp_path / "sample.h5"
    with h5py.File(foreign, "w") as f:
        f["full"] = np.zeros(3)
    with pytest.raises(DataError, match="not a cosmotrain checkpoint"):
        load_checkpoint(foreign)
    partial = save_checkpoint(tmp_path, make_state())
    with h5py.File(partial, "a") as f:
        del f["buffers"]
    with pytest.raises(DamagedCheckpoint, match="metadata fails its checksum"):
        load_checkpoint(partial)
    old = write_v1(tmp_path / "v1.h5", make_state())
    with h5py.File(old, "a") as f:
        del f["buffers"]
    with pytest.raises(DamagedCheckpoint, match="unreadable checkpoint"):      # unverified
        load_checkpoint(old)
    with h5py.File(partial, "a") as f:
        f.attrs["format_version"] = ck.FORMAT_VERSION + 1
    with pytest.raises(DataError, match="upgrade cosmotrain"):
        load_checkpoint(partial)
    with pytest.raises(DataError, match="not found"):
        load_checkpoint(tmp_path / "nope.h5")


@pytest.mark.parametrize("change, error", [
    (lambda s: s.params.update({"a/b": np.zeros(1)}), ValueError),
    (lambda s: s.rng.update({"state": [1, 2]}), TypeError),
    (lambda s: s.rng.update({"state": 2**70}), ValueError),
])
def test_bad_state_is_refused_without_leftovers(tmp_path: Path, change, error) -> None:
    state = make_state()
    change(state)
    with pytest.raises(error):
        save_checkpoint(tmp_path, state)
    assert list(tmp_path.iterdir()) == []


def _tiny_with_grads(seed: int) -> tuple[object, list]:
    model = build_model(ModelConfig(name="tiny", width=8, batchnorm=True), seed=seed)
    return model, list(model.named_parameters())


def _fake_grads(params: list, step: int) -> None:
    for i, (_, p) in enumerate(params):
        p.grad = np.random.default_rng(100 * step + i).normal(size=p.shape).astype(np.float32)


def test_resume_continues_the_same_optimizer_trajectory(tmp_path: Path) -> None:
    """Save after 2 Adam steps, restore into a fresh model + optimizer: 2 more steps give
    bit-identical parameters to the uninterrupted run."""
    model, params = _tiny_with_grads(0)
    opt = Adam(lr=1e-2)
    for step in range(2):
        _fake_grads(params, step)
        opt.step(params)
    state = CheckpointState(step=2, epoch=0, samples_seen=8,
                            params={n: p.data for n, p in params}, optimizer=opt.state)
    path = save_checkpoint(tmp_path, state)
    for step in range(2, 4):
        _fake_grads(params, step)
        opt.step(params)

    _, fresh = _tiny_with_grads(1)
    loaded = load_checkpoint(path)
    for name, p in fresh:
        p.data[...] = loaded.params[name]
    opt2 = Adam(lr=1e-2, state=loaded.optimizer)
    for step in range(2, 4):
        _fake_grads(fresh, step)
        opt2.step(fresh)
    for (name, p), (_, q) in zip(params, fresh):
        assert np.array_equal(p.data, q.data), name


def test_loads_into_the_torch_twin_of_the_tiny_model(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch_mirror import mirror

    model, params = _tiny_with_grads(3)
    buffers = {name: owner.buffers[key] for name, owner, key in model.named_buffers()}
    path = save_checkpoint(tmp_path, CheckpointState(
        step=1, epoch=0, samples_seen=4, params={n: p.data for n, p in params},
        buffers=buffers))
    loaded = load_checkpoint(path)
    twin = mirror(model)
    state = {**loaded.params, **loaded.buffers}
    twin.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()},
                         strict=True)
    for name, tensor in twin.state_dict().items():
        assert tuple(tensor.shape) == np.asarray(state[name]).shape, name
        assert np.array_equal(tensor.numpy(), state[name]), name


def test_copied_checkpoint_loads_anywhere(tmp_path: Path) -> None:
    """Nothing in a checkpoint depends on its directory (resume elsewhere, other layout)."""
    path = save_checkpoint(tmp_path / "a", make_state())
    moved = tmp_path / "b" / path.name
    moved.parent.mkdir()
    shutil.copy(path, moved)
    assert_same(make_state(), load_checkpoint(moved))


# --- checksums (format version 2) ----------------------------------------------------------

BIG = "big.weight"  # 64 KiB: room for 4 KiB of damage inside its data


def make_big_state(step: int = 7, seed: int = 0) -> CheckpointState:
    state = make_state(step, seed)
    big = np.random.default_rng(seed + 1).normal(size=(16, 8, 8, 4, 4)).astype(np.float32)
    state.params[BIG] = big
    state.optimizer[BIG] = {"step": step, "exp_avg": big * 0.5, "exp_avg_sq": big * big}
    return state


def flip(path: Path, dataset: str, count: int = 4096, at: int = 0) -> None:
    """Overwrite ``count`` bytes of ``dataset``'s data (from byte ``at``) with 0xFF."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        offset, size = ds.id.get_offset(), ds.id.get_storage_size()
    assert offset is not None and at + count <= size, (dataset, size)
    with open(path, "r+b") as handle:
        handle.seek(offset + at)
        handle.write(b"\xff" * count)


def write_v1(path: Path, state: CheckpointState) -> Path:
    """A checkpoint exactly as cosmotrain wrote format version 1 (no checksums)."""
    with h5py.File(path, "w", track_order=True) as f:
        f.attrs.update({"format": ck.FORMAT, "format_version": 1, "step": state.step,
                        "epoch": state.epoch, "samples_seen": state.samples_seen})
        f.create_dataset("config", data=state.config_yaml, dtype=h5py.string_dtype())
        for group, arrays in (("params", state.params), ("buffers", state.buffers)):
            g = f.create_group(group, track_order=True)
            for name, value in arrays.items():
                g.create_dataset(name, data=np.asarray(value))
        opt = f.create_group("optimizer", track_order=True)
        opt.attrs.update(state.optimizer_scalars)
        for name, slots in state.optimizer.items():
            g = opt.create_group(name, track_order=True)
            for key, value in slots.items():
                if isinstance(value, np.ndarray):
                    g.create_dataset(key, data=value)
                else:
                    g.attrs[key] = value
        f.create_group("rng").attrs.update(state.rng)
        f.create_group("layout").attrs.update(state.layout)
    return path


def test_every_dataset_carries_a_checksum(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_big_state())
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == ck.FORMAT_VERSION == 2
        assert "checksum" in f.attrs
        datasets: list[str] = []
        f.visititems(lambda name, obj: datasets.append(name)
                     if isinstance(obj, h5py.Dataset) else None)
        assert "params/big.weight" in datasets and "config" in datasets
        for name in datasets:
            assert "crc32" in f[name].attrs, name
        assert int(f["params/big.weight"].attrs["crc32"]) == \
            zlib.crc32(f["params/big.weight"][()].tobytes())


@pytest.mark.parametrize("dataset, count", [
    ("params/big.weight", 4096),
    ("optimizer/big.weight/exp_avg_sq", 4096),
    ("buffers/bn1.running_var", 16),                      # all of a small array's bytes
])
def test_flipped_bytes_inside_an_array_name_the_file_and_the_array(
        tmp_path: Path, dataset: str, count: int) -> None:
    path = save_checkpoint(tmp_path, make_big_state())
    flip(path, dataset, count, at=1024 if count == 4096 else 0)
    with h5py.File(path, "r") as f:                        # HDF5 itself sees nothing wrong
        f[dataset][()]
    with pytest.raises(DamagedCheckpoint) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint '{path}': array '{dataset}' fails its checksum")
    assert "\n" not in message and isinstance(info.value, DataError)
    assert info.value.problem.startswith(f"array '{dataset}'")


def test_changed_scalar_or_config_fails_verification(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_big_state())
    with h5py.File(path, "a") as f:
        f["rng"].attrs["seed"] = 1235
    with pytest.raises(DamagedCheckpoint, match="metadata fails its checksum"):
        load_checkpoint(path)
    path = save_checkpoint(tmp_path, make_big_state(8))
    with h5py.File(path, "a") as f:
        f["config"][()] = CONFIG.replace("tiny", "tinY")
    with pytest.raises(DamagedCheckpoint, match="array 'config' fails its checksum"):
        load_checkpoint(path)


def rewrite(path: Path, dataset: str, data: np.ndarray) -> None:
    """Replace ``dataset`` by ``data`` (the same bytes, another shape or dtype), keeping
    its attributes, its stored CRC-32 among them: only the metadata listing can tell."""
    with h5py.File(path, "a") as f:
        attrs = dict(f[dataset].attrs)
        del f[dataset]
        f.create_dataset(dataset, data=data).attrs.update(attrs)


@pytest.mark.parametrize("reshape", [
    lambda a: a.reshape(a.shape[0], -1),                  # same bytes, another shape
    lambda a: a.view(np.int32),                           # same bytes, a dtype of the same width
], ids=["shape", "dtype"])
def test_same_bytes_in_another_shape_or_dtype_fail_the_metadata_checksum(
        tmp_path: Path, reshape) -> None:
    path = save_checkpoint(tmp_path, make_big_state())
    with h5py.File(path, "r") as f:
        original = f["params/big.weight"][()]
    changed = reshape(original)
    assert changed.tobytes() == original.tobytes()        # the array's own CRC still holds
    rewrite(path, "params/big.weight", changed)
    with pytest.raises(DamagedCheckpoint, match="metadata fails its checksum"):
        load_checkpoint(path)


@pytest.mark.parametrize("key", ["step", "epoch", "samples_seen"])
def test_a_changed_counter_of_the_root_fails_the_metadata_checksum(tmp_path: Path,
                                                                   key: str) -> None:
    path = save_checkpoint(tmp_path, make_big_state())
    with h5py.File(path, "a") as f:
        f.attrs[key] = int(f.attrs[key]) + 1
    with pytest.raises(DamagedCheckpoint, match="metadata fails its checksum"):
        load_checkpoint(path)


def test_a_truncated_checkpoint_is_damaged(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_big_state())
    with h5py.File(path, "r") as f:
        cut = f["params/big.weight"].id.get_offset() + 100   # inside the array's data
    with open(path, "r+b") as handle:
        handle.truncate(cut)
    with pytest.raises(DamagedCheckpoint, match=r"unreadable checkpoint .*truncated") as info:
        load_checkpoint(path)
    assert str(info.value).startswith(f"checkpoint '{path}'")


def test_newest_intact_checkpoint_skips_the_damaged_ones(tmp_path: Path) -> None:
    assert newest_intact_checkpoint(tmp_path / "missing") == (None, None, [])
    paths = [save_checkpoint(tmp_path, make_big_state(step, seed=step))
             for step in (100, 200, 300)]
    found = newest_intact_checkpoint(tmp_path)
    assert found.path == paths[-1] and found.skipped == []
    assert_same(make_big_state(300, seed=300), found.state)

    flip(paths[2], "params/big.weight")
    paths[1].write_bytes(paths[1].read_bytes()[:3000])
    path, state, skipped = newest_intact_checkpoint(tmp_path)
    assert path == paths[0]
    assert_same(make_big_state(100, seed=100), state)
    assert [p for p, _ in skipped] == [paths[2], paths[1]]            # newest first
    assert "array 'params/big.weight' fails its checksum" in skipped[0][1]
    assert "unreadable checkpoint" in skipped[1][1]

    flip(paths[0], "optimizer/big.weight/exp_avg")
    path, state, skipped = newest_intact_checkpoint(tmp_path)
    assert (path, state, len(skipped)) == (None, None, 3)


def test_newest_intact_checkpoint_loads_each_file_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, make_state(step))
    flip(tmp_path / checkpoint_name(3), "buffers/bn1.running_var", 16)
    opened: list[str] = []
    real = ck.h5py.File

    def counting(name: object, *args: object, **kwargs: object) -> object:
        opened.append(Path(str(name)).name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(ck.h5py, "File", counting)
    found = newest_intact_checkpoint(tmp_path)
    assert found.path == tmp_path / checkpoint_name(2) and found.state.step == 2
    assert opened == [checkpoint_name(3), checkpoint_name(2)]


def test_a_newer_format_is_not_skipped_as_damaged(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(1))
    newer = save_checkpoint(tmp_path, make_state(2))
    with h5py.File(newer, "a") as f:
        f.attrs["format_version"] = ck.FORMAT_VERSION + 1
    with pytest.raises(DataError, match="upgrade cosmotrain"):
        newest_intact_checkpoint(tmp_path)


def test_a_version_1_checkpoint_still_loads_unverified(tmp_path: Path) -> None:
    state = make_big_state(50)
    path = write_v1(tmp_path / checkpoint_name(50), state)
    loaded = load_checkpoint(path)
    assert loaded.format_version == 1
    state.format_version = 1
    assert_same(state, loaded)
    found = newest_intact_checkpoint(tmp_path)
    assert found.path == path and found.skipped == []
    flip(path, "params/big.weight")                       # no checksums: undetectable
    assert not np.array_equal(load_checkpoint(path).params[BIG], state.params[BIG])
    resaved = save_checkpoint(tmp_path, loaded)            # a resumed run writes version 2
    with h5py.File(resaved, "r") as f:
        assert f.attrs["format_version"] == 2 and "checksum" in f.attrs


def test_retention_never_lets_damaged_newer_files_push_out_good_ones(tmp_path: Path) -> None:
    """Resumed from step 4 past damaged 8 and 9: writing 5 with keep 2 keeps 4 and 5."""
    for step in (3, 4, 8, 9):
        save_checkpoint(tmp_path, make_state(step))
    for step in (8, 9):
        flip(tmp_path / checkpoint_name(step), "buffers/bn1.running_var", 16)
    found = newest_intact_checkpoint(tmp_path)
    assert found.path == tmp_path / checkpoint_name(4)
    save_checkpoint(tmp_path, make_state(5), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5, 8, 9]
    assert newest_intact_checkpoint(tmp_path).path == tmp_path / checkpoint_name(5)
    save_checkpoint(tmp_path, make_state(8), keep_last=2)    # replaces the damaged 8
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 8, 9]
    assert newest_intact_checkpoint(tmp_path).state.step == 8
