"""The manifest: datagen's manifest.json as is, foreign directories scanned and cached, the
sample index -> (file, sub-cube) map, labels and per-sample means, and the errors.

``write_universes`` and ``expected_sample`` are shared with the other data tests."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmotrain.data.dataset import cache
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.synthetic.datagen import generate_dataset
from cosmotrain.data.dataset.manifest import SCAN_CACHE_NAME, open_manifest
from cosmotrain.data.dataset.sample_table import LABELS_NAME, means_name
from cosmotrain.data.readers.transform import apply_transform
from cosmotrain.errors import ConfigError, DataError


def write_universes(root: Path, width: int, files: int, layout: str, dtype: str,
                    val_files: int = 1, seed: int = 0) -> None:
    """A foreign dataset: ``train/`` and ``validation/`` of random-count cubes, no manifest."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", files), ("validation", val_files)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            volume = rng.poisson(3.0, size=(4, width, width, width)).astype(np.float32)
            volume[0, 0, 0, 0] = 400.0 + i  # out of int16's small-count range, exact
            formats.write_sample(root / split / f"universe_{i:03d}.hdf5", volume,
                                 rng.uniform(-1, 1, 4), layout=layout, dtype=dtype)


def expected_sample(root: Path, split: str, index: int, width: int, files: list[str],
                    transform: str) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``index`` computed independently: the whole file read, the cube sliced out,
    the transform written out in numpy (float64 mean)."""
    with h5py.File(root / files[0], "r") as handle:
        shape = handle["full"].shape
    disk = shape[0] if shape[-1] == 4 else shape[1]
    per_axis = disk // width
    volume, labels = formats.read_sample(root / files[index // per_axis ** 3])
    i, j, k = np.unravel_index(index % per_axis ** 3, (per_axis,) * 3)
    cube = volume[:, i * width:(i + 1) * width, j * width:(j + 1) * width,
                  k * width:(k + 1) * width]
    if transform == "log1p":
        cube = np.log1p(cube)
    elif transform == "mean":
        cube = cube / np.float32(cube.mean(dtype=np.float64))
    return cube, labels


def test_datagen_manifest_is_taken_as_is(tmp_path: Path) -> None:
    generate_dataset(tmp_path, 5, 16, 3, layout="channels-first", dtype="float32",
                     val_fraction=0.2)
    manifest = open_manifest(tmp_path, 8, means=True)
    assert manifest.source == tmp_path / "manifest.json"
    assert manifest.splits == ("train", "validation")
    assert manifest.disk_width == 16 and manifest.cubes_per_file == 8
    assert manifest.count("train") == 32 and manifest.count("validation") == 8
    assert manifest.volume == formats.VolumeInfo((4, 16, 16, 16), "float32", "channels-first")
    path, origin = manifest.locate("train", 13)
    assert path == tmp_path / "train/sample_000001.hdf5" and origin == (8, 0, 8)
    files = list(manifest.files["train"])
    for index in (0, 13, 31):
        cube, labels = expected_sample(tmp_path, "train", index, 8, files, "none")
        np.testing.assert_array_equal(manifest.targets("train", np.array([index]))[0], labels)
        mean = manifest.sample_means("train", np.array([index]))[0]
        assert mean == pytest.approx(cube.mean(dtype=np.float64), rel=1e-12)
    assert (tmp_path / LABELS_NAME).is_file() and (tmp_path / means_name(8)).is_file()
    with pytest.raises(IndexError):
        manifest.locate("train", 32)


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("dtype", formats.DTYPES)
def test_foreign_directory_is_scanned_and_cached(tmp_path: Path, layout: str,
                                                 dtype: str) -> None:
    write_universes(tmp_path, 8, 3, layout, dtype)
    manifest = open_manifest(tmp_path, 4)
    assert manifest.source == tmp_path / SCAN_CACHE_NAME
    assert manifest.files["train"] == tuple(f"train/universe_{i:03d}.hdf5" for i in range(3))
    assert manifest.count("train") == 24 and manifest.volume.dtype == dtype
    assert json.loads((tmp_path / SCAN_CACHE_NAME).read_text())["layout"] == layout
    (tmp_path / "train/universe_001.hdf5").unlink()  # the listing changed: rescanned
    assert open_manifest(tmp_path, 4).count("train") == 16


def test_list_files_and_flat_directories(tmp_path: Path) -> None:
    write_universes(tmp_path / "a", 4, 2, "channels-first", "int16", val_files=2)
    (tmp_path / "a/train.txt").write_text("# LBANN-style list\ntrain/universe_001.hdf5\n")
    (tmp_path / "a/val.txt").write_text("validation/universe_000.hdf5\n")
    manifest = open_manifest(tmp_path / "a", 4)
    assert manifest.files == {"train": ("train/universe_001.hdf5",),
                              "validation": ("validation/universe_000.hdf5",)}
    write_universes(tmp_path / "b", 4, 2, "channels-last", "int16", val_files=0)
    for path in (tmp_path / "b/train").iterdir():
        path.rename(tmp_path / "b" / path.name)
    assert open_manifest(tmp_path / "b", 4).files == {
        "train": ("universe_000.hdf5", "universe_001.hdf5")}


def test_read_only_dataset_caches_in_the_cache_dir(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    write_universes(tmp_path / "data", 4, 2, "channels-last", "int16")
    monkeypatch.setattr(cache, "is_writable", lambda directory: False)
    manifest = open_manifest(tmp_path / "data", 4, cache_dir=str(tmp_path / "cache"))
    where = cache.fallback_dir(tmp_path / "data", tmp_path / "cache")
    assert manifest.source == where / SCAN_CACHE_NAME and (where / LABELS_NAME).is_file()
    assert not (tmp_path / "data" / SCAN_CACHE_NAME).exists()
    again = open_manifest(tmp_path / "data", 4, cache_dir=str(tmp_path / "cache"))
    np.testing.assert_array_equal(again.labels["train"], manifest.labels["train"])


def test_caches_are_written_atomically_and_a_refused_write_is_no_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan and the tables are cached through temporary names of the process's own
    (two jobs may cache one dataset at once); a disk that refuses them costs a rescan next
    time, never the job."""
    write_universes(tmp_path / "data", 4, 2, "channels-last", "int16")
    real = os.replace
    renamed: list[tuple[str, str]] = []

    def replace(src: object, dst: object) -> None:
        renamed.append((Path(str(src)).name, Path(str(dst)).name))
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(os, "replace", replace)
    manifest = open_manifest(tmp_path / "data", 4, means=True)
    assert manifest.count("train") == 2 and manifest.means is not None
    assert sorted(dst for _, dst in renamed) == sorted(
        [SCAN_CACHE_NAME, LABELS_NAME, means_name(4)])
    for src, dst in renamed:
        assert src.startswith(f".{dst}.{os.getpid()}.") and src.endswith(".tmp"), src
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train", "validation"]
    monkeypatch.setattr(os, "replace", real)
    again = open_manifest(tmp_path / "data", 4, means=True)
    np.testing.assert_array_equal(again.means["train"], manifest.means["train"])
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(
        [SCAN_CACHE_NAME, LABELS_NAME, means_name(4), "train", "validation"])


def test_transforms() -> None:
    raw = np.array([[[[[0, 1], [3, 8]]]], [[[[0, 0], [0, 0]]]]], dtype=np.int16)
    np.testing.assert_allclose(apply_transform(raw, "log1p"), np.log1p(raw.astype(np.float64)),
                               rtol=1e-6)
    means = raw.reshape(2, -1).mean(axis=1)
    out = apply_transform(raw, "mean", means)
    np.testing.assert_allclose(out[0], raw[0] / 3.0, rtol=1e-6)
    assert out.dtype == np.float32 and not out[1].any()  # an empty sample stays zero
    assert apply_transform(raw, "none").dtype == np.float32


def test_width_must_divide_the_volumes(tmp_path: Path) -> None:
    write_universes(tmp_path, 8, 1, "channels-last", "int16", val_files=0)
    with pytest.raises(ConfigError, match="model.width.*does not divide the width 8"):
        open_manifest(tmp_path, 3)


def test_bad_files_are_named(tmp_path: Path) -> None:
    """Every file's header is checked when the label table is built."""
    write_universes(tmp_path, 4, 3, "channels-last", "int16")
    odd = tmp_path / "train/universe_001.hdf5"
    cases = {"shape": {"full": np.zeros((8, 8, 8, 4), np.int16)},
             "dtype": {"full": np.zeros((4, 4, 4, 4), np.float32)},
             "missing": {}}
    for problem, content in cases.items():
        with h5py.File(odd, "w") as handle:
            for key, data in {"unitPar": np.zeros(4, np.float32), **content}.items():
                handle[key] = data
        with pytest.raises(DataError) as err:
            open_manifest(tmp_path, 4)
        assert str(odd) in str(err.value), problem
    (tmp_path / "manifest.json").write_text('{"format_version": 1}')
    with pytest.raises(DataError, match="manifest.json.*lacks layout"):
        open_manifest(tmp_path, 4)
    with pytest.raises(DataError, match="no manifest.json and no sample files"):
        open_manifest(_empty(tmp_path), 4)


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("dtype", formats.DTYPES)
def test_read_block_keeps_the_dtype_and_cuts_channels_and_sub_cubes(
        tmp_path: Path, layout: str, dtype: str) -> None:
    write_universes(tmp_path, 6, 1, layout, dtype, val_files=0)
    path = tmp_path / "train/universe_000.hdf5"
    volume, _ = formats.read_sample(path)
    info = formats.probe(path)[0]
    box = (slice(1, 3), slice(0, 2), slice(2, 3))
    block = formats.read_block(path, info, box, origin=(3, 3, 0), channels=slice(1, 3))
    assert block.dtype == np.dtype(dtype) and block.flags.c_contiguous
    np.testing.assert_array_equal(block, volume[1:3, 4:6, 3:5, 2:3])
    assert formats.read_block(path, info, (slice(0, 0),) * 3).shape == (4, 0, 0, 0)
    other = formats.VolumeInfo(info.shape, "float32" if dtype == "int16" else "int16", layout)
    with pytest.raises(DataError, match=f"is {dtype} but the dataset's files are"):
        formats.read_block(path, other, box)


def test_log1p_of_int16_counts_by_table_has_numpys_bits() -> None:
    """Every int16 value (negatives too) and a block of counts: the table's float32 result is
    bit for bit ``np.log1p``'s, so the faster path changes no trajectory."""
    every = np.arange(1 << 16, dtype=np.uint16).view(np.int16).reshape(1, 4, 16, 32, 32)
    block = np.random.default_rng(0).integers(0, 400, (2, 4, 8, 8, 8)).astype(np.int16)
    with np.errstate(divide="ignore", invalid="ignore"):
        for raw in (every, block, block[:, 1:3, ::2]):
            got, want = apply_transform(raw, "log1p"), np.log1p(raw, dtype=np.float32)
            assert got.dtype == np.float32 and got.shape == raw.shape
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
