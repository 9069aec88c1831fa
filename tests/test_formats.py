"""The sample formats (HDF5, MLPerf TFRecord plain and gzip, NVIDIA numpy): the same samples
read alike in each, independent encoders read, damage named, scan, staging and convert.

Every dataset here holds the same synthetic samples (``datagen --format``), so each format
must hand the readers the very same bytes as HDF5: blocks, sub-cubes, labels and means.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest

from cosmotrain.config.load import load_config
from cosmotrain.data.formats import interface as formats, tfrecord as tfrecord_sample
from cosmotrain.data.synthetic.datagen import generate_dataset
from cosmotrain.data.dataset.manifest import MANIFEST_NAME, open_manifest
from cosmotrain.errors import ConfigError, DataError, UserError

SAMPLES, WIDTH, SEED = 5, 16, 3
KINDS = {"hdf5": ("hdf5", False), "tfrecord": ("tfrecord", False),
         "tfrecord-gzip": ("tfrecord", True), "npy": ("npy", False)}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same samples in every format (with manifests) and, without manifests, as found
    in the wild (the scan must recognise them)."""
    base = tmp_path_factory.mktemp("formats")
    roots = {}
    for kind, (format, packed) in KINDS.items():
        roots[kind] = base / kind
        generate_dataset(roots[kind], SAMPLES, WIDTH, SEED, val_fraction=0.2, format=format,
                         gzip=packed)
        roots[f"{kind}-scanned"] = base / f"{kind}-scanned"
        shutil.copytree(roots[kind], roots[f"{kind}-scanned"])
        (roots[f"{kind}-scanned"] / MANIFEST_NAME).unlink()
    return roots


def fresh_copy(source: Path, target: Path) -> Path:
    """A copy of a dataset without its caches (a label table built before the damage
    would spare the damaged file its check)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("cosmotrain-*"))
    return target


def first_file(root: Path) -> Path:
    return root / open_manifest(root, None).files["train"][0]


@pytest.mark.parametrize("kind", [*KINDS, *(f"{k}-scanned" for k in KINDS)])
def test_every_format_holds_the_same_samples_as_hdf5(datasets: dict[str, Path],
                                                     kind: str) -> None:
    reference = open_manifest(datasets["hdf5"], 8, means=True)
    manifest = open_manifest(datasets[kind], 8, means=True)
    assert manifest.volume.format == KINDS[kind.removesuffix("-scanned")][0]
    assert manifest.count("train") == reference.count("train") == 4 * 8
    for split in ("train", "validation"):
        np.testing.assert_array_equal(manifest.labels[split], reference.labels[split])
        np.testing.assert_array_equal(manifest.means[split], reference.means[split])
    box = (slice(2, 7), slice(0, 8), slice(3, 4))
    for sample in (0, 9, 31):  # sub-cubes of the 16^3 files at model width 8
        path, origin = manifest.locate("train", sample)
        ref_path, ref_origin = reference.locate("train", sample)
        assert origin == ref_origin
        got = formats.read_block(path, manifest.volume, box, origin, slice(1, 3))
        want = formats.read_block(ref_path, reference.volume, box, origin, slice(1, 3))
        assert got.dtype == np.int16 and np.array_equal(got, want)


def test_read_sample_is_the_same_in_every_format(datasets: dict[str, Path]) -> None:
    volume, labels = formats.read_sample(first_file(datasets["hdf5"]))
    for kind in KINDS:
        got, got_labels = formats.read_sample(first_file(datasets[kind]))
        assert np.array_equal(got, volume) and np.array_equal(got_labels, labels), kind


def test_gzip_files_are_whole_file_gzip_streams(datasets: dict[str, Path]) -> None:
    packed, plain = first_file(datasets["tfrecord-gzip"]), first_file(datasets["tfrecord"])
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and tfrecord_sample.is_gzip(packed)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    # framing, Example headers and 4 labels: 66 bytes here; 71 at 128^3, whose length
    # varints are a byte longer (16,777,287 bytes: tests/test_tfrecord_codec.py)
    assert plain.stat().st_size == 16 ** 3 * 4 * 2 + 66


def test_a_file_written_by_the_tfrecord_package_is_read(datasets: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """An independent encoder (PyPI ``tfrecord``): its records, plain and gzip, read the
    same as cosmotrain's own HDF5 samples; the directory is found by the scan."""
    writer = pytest.importorskip("tfrecord.writer")
    reference = open_manifest(datasets["hdf5"], None)
    for split, names in reference.files.items():
        (tmp_path / split).mkdir()
        for i, name in enumerate(names):
            volume, labels = formats.read_sample(reference.root / name)
            raw = np.ascontiguousarray(np.moveaxis(volume, 0, -1).astype("<i2")).tobytes()
            target = tmp_path / split / f"univ_{i:03d}.tfrecord"
            record = writer.TFRecordWriter(str(target))
            record.write({"y": (labels.tolist(), "float"), "x": (raw, "byte")})
            record.close()
            if i % 2:  # MLPerf v1.0: the same name, gzip inside
                target.write_bytes(gzip.compress(target.read_bytes()))
    manifest = open_manifest(tmp_path, 8)
    assert manifest.volume == formats.VolumeInfo((16, 16, 16, 4), "int16", "channels-last",
                                                 "tfrecord")
    for split in reference.files:
        np.testing.assert_array_equal(manifest.labels[split], reference.labels[split])
        for i, name in enumerate(manifest.files[split]):
            got = formats.read_block(tmp_path / name, manifest.volume)
            want = formats.read_block(reference.root / reference.files[split][i],
                                      reference.volume)
            assert np.array_equal(got, want)


def test_a_float_list_volume_is_read_as_float32(datasets: dict[str, Path],
                                               tmp_path: Path) -> None:
    """Older preparations stored ``x`` as a packed float_list (the PyPI ``tfrecord``
    package writes it here, independently): a float32 dataset holding the same counts,
    memory-mapped like the bytes; a NaN in it is named when read."""
    writer = pytest.importorskip("tfrecord.writer")
    reference = open_manifest(datasets["hdf5"], None)
    (tmp_path / "train").mkdir()
    names = reference.files["train"]
    for i, name in enumerate(names):
        volume, labels = formats.read_sample(reference.root / name)
        values = np.moveaxis(volume, 0, -1).astype(np.float32).ravel()
        if i == 1:
            values[5] = np.nan
        record = writer.TFRecordWriter(str(tmp_path / "train" / f"univ_{i:03d}.tfrecord"))
        record.write({"x": (values.tolist(), "float"), "y": (labels.tolist(), "float")})
        record.close()
    manifest = open_manifest(tmp_path, 8)
    assert manifest.volume == formats.VolumeInfo((16, 16, 16, 4), "float32",
                                                 "channels-last", "tfrecord")
    np.testing.assert_array_equal(manifest.labels["train"], reference.labels["train"])
    box = (slice(2, 9), slice(0, 16), slice(3, 11))
    got = formats.read_block(tmp_path / manifest.files["train"][0], manifest.volume, box)
    want = formats.read_block(reference.root / names[0], reference.volume, box)
    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))
    with pytest.raises(DataError, match="univ_001.tfrecord'.*non-finite"):
        formats.read_block(tmp_path / manifest.files["train"][1], manifest.volume)


def test_nvidia_numpy_lists_are_followed_and_checked(datasets: dict[str, Path],
                                                     tmp_path: Path) -> None:
    root = tmp_path / "nv"
    fresh_copy(datasets["npy-scanned"], root)
    train = root / "train"
    names = (train / "files_data.lst").read_text().split()
    (train / "files_data.lst").write_text("\n".join(reversed(names)) + "\n")
    with pytest.raises(DataError, match=r"files_label.lst.*entry 1 is .* but the labels of"):
        open_manifest(root, 8)
    (train / "files_label.lst").unlink()  # the labels are found beside each volume
    manifest = open_manifest(root, 8)
    assert [Path(f).name for f in manifest.files["train"]] == list(reversed(names))
    (train / names[0].replace("_data", "_label")).unlink()
    (root / "cosmotrain-labels.npz").unlink()  # the label cache is keyed on the file list
    unlabelled = open_manifest(root, 8)
    assert unlabelled.unlabelled_files("train") == (f"train/{names[0]}",)
    with pytest.raises(DataError, match="has no '_label.npy' labels"):
        unlabelled.require_labels("train")


def test_two_formats_in_one_directory_need_data_format(datasets: dict[str, Path],
                                                       tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    fresh_copy(datasets["hdf5-scanned"], root)
    for path in (datasets["tfrecord-scanned"] / "train").iterdir():
        shutil.copy(path, root / "train")
    with pytest.raises(DataError, match="mixes sample files of formats hdf5, tfrecord.*"
                                        "data.format"):
        open_manifest(root, 8)
    assert open_manifest(root, 8, format="tfrecord").volume.format == "tfrecord"
    assert open_manifest(root, 8, format="hdf5").volume.format == "hdf5"
    with pytest.raises(ConfigError, match="data.format': is npy but .*describes tfrecord"):
        open_manifest(datasets["tfrecord"], 8, format="npy")
    cfg = load_config(None, ["data.format=tfrecord"])
    assert cfg.data.format == "tfrecord"
    with pytest.raises(ConfigError, match="data.format"):
        load_config(None, ["data.format=tfrecords"])


def damage_tfrecord(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "payload byte":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncated":
        del data[len(data) - 100:]
    elif how == "length":
        data[0] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how,message", [
    ("payload byte", "payload CRC mismatch"), ("truncated", "truncated"),
    ("length", "length CRC mismatch")])
def test_a_damaged_tfrecord_is_named(datasets: dict[str, Path], tmp_path: Path, how: str,
                                     message: str) -> None:
    root = tmp_path / "d"
    fresh_copy(datasets["tfrecord-scanned"], root)
    victim = root / "train" / "sample_000002.tfrecord"
    damage_tfrecord(victim, how)
    with pytest.raises(DataError, match=f"data file '{victim}': .*{message}"):
        open_manifest(root, 8)


def test_a_truncated_gzip_stream_is_named(datasets: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "g"
    fresh_copy(datasets["tfrecord-gzip-scanned"], root)
    victim = root / "validation" / "sample_000004.tfrecord"
    victim.write_bytes(victim.read_bytes()[:-30])
    with pytest.raises(DataError, match=f"'{victim}': is a damaged or truncated gzip stream"):
        open_manifest(root, 8)


def test_tfrecord_features_of_the_wrong_kind_are_named(tmp_path: Path) -> None:
    from cosmotrain.data.formats.tfrecord_codec import encode_example, frame_record

    cube = np.zeros((8, 8, 8, 4), np.int16).tobytes()
    cases = {"no x": ({"y": np.zeros(4, np.float32)}, "has no feature 'x'"),
             "wrong length": ({"x": cube[:-2], "y": np.zeros(4, np.float32)},
                              "feature 'x' holds 4094 bytes, not an int16 cube"),
             "wrong float count": ({"x": np.zeros(8 ** 3 * 4 - 1, np.float32)},
                                   "feature 'x' holds 8188 bytes, not a float32 cube"),
             "int64 x": ({"x": np.zeros(8, np.int64)},
                         r"feature 'x': expected one bytes value, found 8 int64 value\(s\)"),
             "five labels": ({"x": cube, "y": np.zeros(5, np.float32)},
                             r"feature 'y' has shape \(5,\)"),
             "label range": ({"x": cube, "y": np.full(4, 3, np.float32)},
                             r"feature 'y' holds a label outside \[-1, 1\]")}
    for name, (features, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.tfrecord"
        path.write_bytes(frame_record(encode_example(features)))
        with pytest.raises(DataError, match=f"'{path}': {message}"):
            formats.probe(path)
    unlabelled = tmp_path / "predict_me.tfrecord"
    unlabelled.write_bytes(frame_record(encode_example({"x": cube})))
    assert np.isnan(formats.probe(unlabelled)[1]).all()


def test_damaged_npy_files_are_named(datasets: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "n"
    fresh_copy(datasets["npy-scanned"], root)
    victim = root / "train" / "sample_000001_data.npy"
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(DataError, match=f"'{victim}': is .* bytes but its header promises"):
        open_manifest(root, 8)
    np.save(victim, np.zeros((16, 16, 16, 3), np.int16))
    with pytest.raises(DataError, match=f"'{victim}': .*has shape \\(16, 16, 16, 3\\)"):
        open_manifest(root, 8)
    np.save(victim, np.asfortranarray(np.zeros((16, 16, 16, 4), np.int16)))
    with pytest.raises(DataError, match=f"'{victim}': holds a Fortran-order array"):
        open_manifest(root, 8)
    labels = root / "train" / "sample_000001_label.npy"
    np.save(victim, np.zeros((16, 16, 16, 4), np.int16))
    np.save(labels, np.array([0, 0, np.nan, 0], np.float32))
    with pytest.raises(DataError, match=f"'{labels}': '_label.npy' holds a non-finite"):
        open_manifest(root, 8)


def test_formats_refuse_what_they_cannot_hold(tmp_path: Path) -> None:
    volume = np.ones((4, 8, 8, 8), np.float32)
    with pytest.raises(UserError, match="TFRecord samples hold int16 channels-last"):
        formats.write_sample(tmp_path / "a.tfrecord", volume, np.zeros(4), format="tfrecord",
                             dtype="float32")
    with pytest.raises(UserError, match="--gzip compresses TFRecord files only"):
        formats.write_sample(tmp_path / "a.hdf5", volume, np.zeros(4), gzip=True)
    with pytest.raises(UserError, match="--format tfrecord holds int16 channels-last"):
        generate_dataset(tmp_path / "x", 2, 8, 0, format="tfrecord", layout="channels-first")
