"""Dataset writing: HDF5 formats, determinism, round-robin ranks, split, manifest, errors."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmotrain.data.synthetic import datagen, universes as synthetic
from cosmotrain.data.dataset import file_sums
from cosmotrain.data.formats import interface as formats
from cosmotrain.errors import DataError, UserError


class FakeComm:
    """Just enough of an mpi4py communicator to play one rank of ``size`` in a single process.

    ``others`` are the values the other ranks contribute to ``allgather`` (None: no error).
    """

    def __init__(self, rank: int, size: int, others: object = None) -> None:
        self.rank, self.size, self.others = rank, size, others

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def allgather(self, value: object) -> list[object]:
        gathered = [self.others] * self.size
        gathered[self.rank] = value
        return gathered

    def barrier(self) -> None:
        pass


def _arrays(out_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every sample file under ``out_dir``: relative path -> (raw ``full``, ``unitPar``)."""
    result = {}
    for path in sorted(out_dir.glob("*/sample_*.hdf5")):
        with h5py.File(path, "r") as handle:
            result[str(path.relative_to(out_dir))] = (handle["full"][()], handle["unitPar"][()])
    return result


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path / "a", 4, 16, 11)
    datagen.generate_dataset(tmp_path / "b", 4, 16, 11)
    first, second = _arrays(tmp_path / "a"), _arrays(tmp_path / "b")
    assert len(first) == 4 and first.keys() == second.keys()
    for name, (volume, labels) in first.items():
        assert volume.tobytes() == second[name][0].tobytes()
        assert labels.tobytes() == second[name][1].tobytes()


def test_different_seeds_differ(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path / "a", 2, 16, 1)
    datagen.generate_dataset(tmp_path / "b", 2, 16, 2)
    for name, (volume, labels) in _arrays(tmp_path / "a").items():
        other_volume, other_labels = _arrays(tmp_path / "b")[name]
        assert not np.array_equal(volume, other_volume)
        assert not np.array_equal(labels, other_labels)


@pytest.mark.parametrize("layout", formats.LAYOUTS)
@pytest.mark.parametrize("dtype", formats.DTYPES)
def test_layouts_and_dtypes_on_disk(tmp_path: Path, layout: str, dtype: str) -> None:
    datagen.generate_dataset(tmp_path, 2, 16, 0, layout=layout, dtype=dtype)
    expected = (16, 16, 16, 4) if layout == "channels-last" else (4, 16, 16, 16)
    with h5py.File(tmp_path / "train" / "sample_000000.hdf5", "r") as handle:
        assert handle["full"].shape == expected and handle["full"].dtype == np.dtype(dtype)
        assert handle["unitPar"].shape == (4,) and handle["unitPar"].dtype == np.float32
        assert handle.attrs["layout"] == layout
    volume, labels = formats.read_sample(tmp_path / "train" / "sample_000000.hdf5")
    params = synthetic.sample_parameters(0, 0)
    np.testing.assert_array_equal(labels, params)
    np.testing.assert_array_equal(volume, synthetic.generate_volume(params, 16, 0, 0))


def test_default_is_channels_last_int16(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path, 2, 8, 0)
    with h5py.File(tmp_path / "train" / "sample_000000.hdf5", "r") as handle:
        assert handle["full"].shape == (8, 8, 8, 4) and handle["full"].dtype == np.int16


def test_read_sample_infers_layout_without_attribute(tmp_path: Path) -> None:
    cdhw = np.arange(4 * 8**3, dtype=np.float32).reshape(4, 8, 8, 8)
    for layout, stored in (("channels-last", np.moveaxis(cdhw, 0, -1)), ("channels-first", cdhw)):
        path = tmp_path / f"{layout}.hdf5"
        with h5py.File(path, "w") as handle:  # a foreign file: no layout attribute
            handle["full"] = stored.astype(np.int16)
            handle["unitPar"] = np.zeros(4, np.float32)
        volume, _ = formats.read_sample(path)
        np.testing.assert_array_equal(volume, cdhw.astype(np.int16))


def test_a_file_without_labels_reads_as_nan_labels(tmp_path: Path) -> None:
    path = tmp_path / "unlabelled.hdf5"
    with h5py.File(path, "w") as handle:
        handle["full"] = np.ones((8, 8, 8, 4), np.int16)
    volume, labels = formats.read_sample(path)
    assert volume.shape == (4, 8, 8, 8) and np.isnan(labels).all() and labels.shape == (4,)
    assert np.isnan(formats.probe(path)[1]).all()


def test_read_sample_names_the_file_on_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "bad.hdf5"
    with h5py.File(path, "w") as handle:
        handle["full"] = np.zeros((8, 8, 8, 4), np.int16)
        handle["unitPar"] = np.zeros(3, np.float32)
    with pytest.raises(DataError, match="bad.hdf5.*unitPar"):
        formats.read_sample(path)
    with pytest.raises(DataError, match="missing.hdf5"):
        formats.read_sample(tmp_path / "missing.hdf5")


def test_int16_encoding_rounds_and_clips() -> None:
    encoded = formats.encode_counts(np.array([-1.0, 2.0, 40000.0]), "int16")
    np.testing.assert_array_equal(encoded, [0, 2, 32767])
    assert encoded.dtype == np.int16


def test_round_robin_over_fake_ranks_gives_same_files(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path / "serial", 7, 8, 3)
    counts = {}
    for rank in (0, 1, 2):  # rank 0 first: it prepares the directory
        written: list[int] = []
        datagen.generate_dataset(tmp_path / "ranks", 7, 8, 3, comm=FakeComm(rank, 3),
                                 progress=written.append)
        counts[rank] = written
    assert counts == {0: [1, 2, 3], 1: [1, 2], 2: [1, 2]}
    serial, ranks = _arrays(tmp_path / "serial"), _arrays(tmp_path / "ranks")
    assert serial.keys() == ranks.keys() and len(serial) == 7
    for name, (volume, labels) in serial.items():
        assert volume.tobytes() == ranks[name][0].tobytes()
        assert labels.tobytes() == ranks[name][1].tobytes()
    serial_manifest = json.loads((tmp_path / "serial" / "manifest.json").read_text())
    ranks_manifest = json.loads((tmp_path / "ranks" / "manifest.json").read_text())
    sums = serial_manifest.pop("checksums")  # fake ranks gather no one else's checksums
    assert ranks_manifest.pop("checksums")["algorithm"] == sums["algorithm"] == "crc32c"
    assert serial_manifest == ranks_manifest
    assert sums["files"] == {name: list(s) for name, s in file_sums.sum_files(
        tmp_path / "ranks", [name for name in sums["files"]]).items()}  # the same bytes


def test_an_error_on_another_rank_is_raised_here(tmp_path: Path) -> None:
    comm = FakeComm(1, 2, others="'x/manifest.json' already exists")
    with pytest.raises(UserError, match="already exists"):
        datagen.generate_dataset(tmp_path, 4, 8, 0, comm=comm)
    assert not list(tmp_path.glob("*/sample_*"))  # nothing written before the verdict


@pytest.mark.parametrize(
    "samples, fraction, expected",
    [(1, 0.125, 0), (2, 0.125, 1), (8, 0.125, 1), (16, 0.125, 2), (20, 0.125, 2),
     (10, 0.0, 0), (4, 0.9, 3), (64, 0.25, 16)],
)
def test_validation_count(samples: int, fraction: float, expected: int) -> None:
    assert datagen.validation_count(samples, fraction) == expected


def test_validation_split_is_the_last_indices(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path, 10, 8, 0, val_fraction=0.2)
    names = sorted(p.name for p in (tmp_path / "validation").glob("*.hdf5"))
    assert names == ["sample_000008.hdf5", "sample_000009.hdf5"]
    assert len(list((tmp_path / "train").glob("*.hdf5"))) == 8
    assert not list(tmp_path.rglob("*.tmp"))


def test_manifest_contents(tmp_path: Path) -> None:
    returned = datagen.generate_dataset(tmp_path, 5, 8, 9, layout="channels-first",
                                        dtype="float32", val_fraction=0.4)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest == returned
    assert manifest["format_version"] == 1
    assert manifest["generator"] == synthetic.GENERATOR_NAME
    assert (manifest["seed"], manifest["width"], manifest["samples"]) == (9, 8, 5)
    assert (manifest["layout"], manifest["dtype"]) == ("channels-first", "float32")
    assert manifest["volume_shape"] == [4, 8, 8, 8] and manifest["labels_shape"] == [4]
    assert manifest["splits"]["train"] == {
        "count": 3, "files": [f"train/sample_{i:06d}.hdf5" for i in range(3)]}
    assert manifest["splits"]["validation"] == {
        "count": 2, "files": ["validation/sample_000003.hdf5", "validation/sample_000004.hdf5"]}
    for split in manifest["splits"].values():
        assert all((tmp_path / name).is_file() for name in split["files"])


def test_refuses_existing_dataset_unless_overwrite(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path, 6, 8, 0, val_fraction=0.5)
    with pytest.raises(UserError, match="manifest.json.*already exists.*--overwrite"):
        datagen.generate_dataset(tmp_path, 2, 8, 1)
    manifest = datagen.generate_dataset(tmp_path, 2, 8, 1, overwrite=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/sample_*")) == [
        "train/sample_000000.hdf5", "validation/sample_000001.hdf5"]  # stale files gone
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == manifest["seed"] == 1


def test_refuses_samples_without_manifest_unless_overwrite(tmp_path: Path) -> None:
    datagen.generate_dataset(tmp_path, 4, 8, 0)
    (tmp_path / "manifest.json").unlink()  # as if the run had been interrupted
    with pytest.raises(UserError, match="4 sample files but no manifest.*--overwrite"):
        datagen.generate_dataset(tmp_path, 2, 8, 0)
    datagen.generate_dataset(tmp_path, 2, 8, 0, overwrite=True)
    assert len(_arrays(tmp_path)) == 2


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"samples": 0}, "samples must be at least 1"),
        ({"width": 6}, "width must be an even number >= 8"),
        ({"width": 17}, "width must be an even number >= 8"),
        ({"seed": -1}, "seed must be a non-negative integer"),
        ({"layout": "NDHWC"}, "layout must be one of channels-last, channels-first"),
        ({"dtype": "uint8"}, "dtype must be one of int16, float32"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\)"),
        ({"val_fraction": -0.1}, r"val_fraction must be in \[0, 1\)"),
        ({"val_fraction": math.nan}, r"val_fraction must be in \[0, 1\)"),
    ],
)
def test_argument_errors(tmp_path: Path, kwargs: dict, pattern: str) -> None:
    arguments = {"out_dir": tmp_path / "out", "samples": 2, "width": 8, "seed": 0} | kwargs
    with pytest.raises(UserError, match=pattern) as info:
        datagen.generate_dataset(**arguments)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()  # validated before any write


def test_unwritable_output_is_a_user_error(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with pytest.raises(UserError, match="cannot prepare output directory.*--out"):
        datagen.generate_dataset(not_a_directory, 2, 8, 0)


@pytest.mark.parametrize("fails", ["sample", "manifest"])
def test_a_failed_write_is_one_line_naming_the_file(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    fails: str) -> None:
    """Samples and the manifest go through the atomic writer: the disk's refusal is one
    collective line naming the file, and no ``.tmp`` is left."""
    failed = tmp_path / ("manifest.json" if fails == "manifest" else "train/sample_000000.hdf5")
    real = os.replace

    def replace(src: object, dst: object) -> None:
        if Path(str(dst)) == failed:
            raise OSError(errno.EROFS, "Read-only file system")
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(UserError) as info:
        datagen.generate_dataset(tmp_path, 3, 8, 0, comm=FakeComm(0, 1))
    assert str(info.value) == (f"cannot write '{failed}': Read-only file system; the "
                               f"filesystem is read-only: choose another --out")
    assert info.value.collective
    assert not list(tmp_path.rglob("*.tmp")) and not failed.exists()
