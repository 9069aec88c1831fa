"""TFRecord files of several records (the 2019_02 universes, 64 a file): the scan lists
every record as ``<file>#<k>``, each reads as its own sample, the labels are the
records', and staging, ``convert`` and the readers take the addresses like files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_preload_staging import first_batch

from cosmotrain.data.formats import interface as formats, tfrecord as tfrecord_sample
from cosmotrain.data.dataset.manifest import open_manifest
from cosmotrain.data.formats.tfrecord_codec import encode_example, frame_record
from cosmotrain.errors import DataError

W = 8
RECORDS = 3


def samples(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` (channels-last int16-valued volume, labels) pairs."""
    rng = np.random.default_rng(seed)
    return [(rng.poisson(3.0, size=(W, W, W, 4)).astype(np.int16),
             rng.uniform(-1, 1, 4).astype(np.float32)) for _ in range(count)]


def write_ours(path: Path, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Several records in one file, ``x`` as MLPerf's int16 bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(frame_record(encode_example({"x": x.tobytes(), "y": y}))
                              for x, y in pairs))


def write_package(path: Path, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Several records in one file by the PyPI ``tfrecord`` package, ``x`` as a float_list
    (as the reference's early preparation wrote them)."""
    writer = pytest.importorskip("tfrecord.writer")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = writer.TFRecordWriter(str(path))
    for x, y in pairs:
        record.write({"x": (x.astype(np.float32).ravel().tolist(), "float"),
                      "y": (y.tolist(), "float")})
    record.close()


@pytest.fixture(params=["ours", "package"])
def dataset(request, tmp_path: Path) -> tuple[Path, dict[str, list]]:
    """Two train files and one validation file of RECORDS records each."""
    write = write_ours if request.param == "ours" else write_package
    written: dict[str, list] = {}
    for split, files in (("train", 2), ("validation", 1)):
        written[split] = []
        for i in range(files):
            pairs = samples(10 * i + len(split), RECORDS)
            write(tmp_path / split / f"univ_{i:03d}.tfrecord", pairs)
            written[split] += pairs
    return tmp_path, written


def test_every_record_is_a_sample(dataset: tuple[Path, dict[str, list]]) -> None:
    root, written = dataset
    manifest = open_manifest(root, 4, means=True)  # 8 sub-cubes of 4^3 per record
    assert manifest.files["train"] == tuple(
        f"train/univ_{i:03d}.tfrecord#{k}" for i in range(2) for k in range(RECORDS))
    assert manifest.count("train") == 2 * RECORDS * 8
    for split, pairs in written.items():
        np.testing.assert_array_equal(manifest.labels[split], [y for _, y in pairs])
        for index, (x, _) in enumerate(pairs):
            block = formats.read_block(root / manifest.files[split][index], manifest.volume)
            np.testing.assert_array_equal(block, np.moveaxis(x, -1, 0))
    path, origin = manifest.locate("train", 8 * 4 + 5)  # record 1 of file 1, cube 5
    assert path == root / "train/univ_001.tfrecord#1" and origin == (4, 0, 4)
    cube = np.moveaxis(written["train"][4][0], -1, 0)[:, 4:8, 0:4, 4:8]
    mean = manifest.sample_means("train", np.array([8 * 4 + 5]))[0]
    assert mean == pytest.approx(cube.mean(dtype=np.float64), rel=1e-12)


def test_the_scan_is_redone_when_the_first_file_changes(tmp_path: Path) -> None:
    """The scan cache keys on the file holding the first record, not on its address."""
    write_ours(tmp_path / "train/univ_000.tfrecord", samples(1, RECORDS))
    assert open_manifest(tmp_path, W).count("train") == RECORDS
    before = (tmp_path / "train/univ_000.tfrecord").stat().st_mtime_ns
    write_ours(tmp_path / "train/univ_000.tfrecord", samples(2, RECORDS + 1))
    os.utime(tmp_path / "train/univ_000.tfrecord", ns=(before + 10**9, before + 10**9))
    assert open_manifest(tmp_path, W).count("train") == RECORDS + 1


def test_records_are_refused_without_an_address_and_beyond_the_file(tmp_path: Path) -> None:
    write_ours(tmp_path / "many.tfrecord", samples(1, RECORDS))
    with pytest.raises(DataError, match=r"many.tfrecord': holds 3 records, not one; "
                                        r"address them as 'many.tfrecord#0' to '#2'"):
        formats.probe(tmp_path / "many.tfrecord")
    with pytest.raises(DataError, match=r"many.tfrecord#5': has 3 record\(s\), no record 5"):
        formats.probe(tmp_path / "many.tfrecord#5")
    assert tfrecord_sample.record_count(tmp_path / "many.tfrecord") == RECORDS
    assert formats.format_of("a/many.tfrecord#2") == formats.TFRECORD
    assert formats.sample_file("a/many.tfrecord#2") == Path("a/many.tfrecord")
    assert formats.sample_file("a/odd#2.hdf5") == Path("a/odd#2.hdf5")
    assert formats.renamed("t/many.tfrecord#2", "tfrecord", "hdf5") == "t/many_002.hdf5"


def test_a_scan_of_one_record_files_counts_only_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(4):
        write_ours(tmp_path / "train" / f"s{i}.tfrecord", samples(i, 1))
    counted: list[str] = []
    count = tfrecord_sample.record_count

    def counting(path: Path) -> int:
        counted.append(Path(path).name)
        return count(path)
    monkeypatch.setattr(tfrecord_sample, "record_count", counting)
    manifest = open_manifest(tmp_path, W)
    assert manifest.files["train"] == tuple(f"train/s{i}.tfrecord" for i in range(4))
    assert counted == ["s0.tfrecord"]


def test_convert_and_staging_take_records(cli, tmp_path: Path,
                                          dataset: tuple[Path, dict[str, list]]) -> None:
    root, written = dataset
    code, _, err = cli("convert", "--data", str(root), "--out", str(tmp_path / "h5"),
                       "--format", "hdf5")
    assert code == 0, err
    converted = open_manifest(tmp_path / "h5", None)
    assert converted.files["train"][:2] == ("train/univ_000_000.hdf5",
                                            "train/univ_000_001.hdf5")
    for split, pairs in written.items():
        np.testing.assert_array_equal(converted.labels[split], [y for _, y in pairs])
    code, out, err = cli("preload", "--set", f"data.path={root}", "--set", "model.width=4",
                         "--set", "train.batch_size=6", "--dest", str(tmp_path / "stage"))
    assert code == 0, err
    assert "staged 3 file(s)" in out  # each file copied once, its records all checked
    assert open_manifest(tmp_path / "stage", 4).files == open_manifest(root, 4).files
    np.testing.assert_array_equal(first_batch(tmp_path / "stage"), first_batch(root))
