"""The TFRecord/Example codec: checksums, round trips, another encoder and decoder, damage.

The PyPI ``tfrecord`` package (protobuf's own serializer) is the independent reference:
records it writes must parse here, and records written here must read back there.
Protobuf details the CosmoFlow writer never uses (unpacked scalars, unknown fields,
repeated ``features``) are built by hand with the few helpers below.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest

from cosmotrain.data.formats.tfrecord_codec import (FOOTER_BYTES, HEADER_BYTES, Feature,
                                                     TFRecordError, bytes_value, encode_example,
                                                     float_values, frame_record, int64_values,
                                                     masked_crc32c, parse_example, parse_record,
                                                     record_size)

LABELS = np.array([0.25, -0.5, 0.75, -1.0], dtype=np.float32)
COSMOFLOW_CUBE_BYTES = 128**3 * 4 * 2
COSMOFLOW_FILE_BYTES = 16_777_287  # an uncompressed MLPerf CosmoFlow v0.7 file


def cube(width: int = 8, seed: int = 0) -> np.ndarray:
    """A small int16 [W, W, W, 4] cube, like CosmoFlow's ``x``."""
    rng = np.random.default_rng(seed)
    return rng.integers(-300, 3000, size=(width, width, width, 4)).astype("<i2")


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def field(number: int, body: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(body)) + body


def entry(key: str, feature: bytes) -> bytes:
    """One ``Features.feature`` map entry, value first (order must not matter)."""
    return field(1, field(2, feature) + field(1, key.encode()))


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def parse_mapped(path: Path, **kwargs) -> tuple[dict, np.ndarray, np.ndarray]:
    """Parse a file through ``mmap``; return features, the cube (copied) and the labels."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        record = parse_record(mapped, **kwargs)
        with bytes_value(mapped, record.features["x"]) as x:
            volume = np.frombuffer(x, "<i2").copy()
        labels = float_values(mapped, record.features["y"])
    return record.features, volume, labels


# --- checksums --------------------------------------------------------------------------

def test_crc32c_check_value_and_masking() -> None:
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    assert masked_crc32c(b"123456789") == 0xC78AB0E5  # rotate right 15, add MASK_DELTA
    assert masked_crc32c(memoryview(b"0123456789")[1:]) == masked_crc32c(b"123456789")


def test_masked_crc32c_matches_the_tfrecord_package() -> None:
    writer = pytest.importorskip("tfrecord.writer")
    for data in (b"", b"a", struct.pack("<Q", 16_777_271), cube().tobytes()):
        assert struct.pack("<I", masked_crc32c(data)) == writer.TFRecordWriter.masked_crc(data)


# --- round trips ------------------------------------------------------------------------

@pytest.mark.parametrize("order", [("x", "y"), ("y", "x")])
def test_round_trip_in_either_key_order(order: tuple[str, str]) -> None:
    volume = cube()
    values = {"x": volume.tobytes(), "y": LABELS}
    data = frame_record(encode_example({key: values[key] for key in order}))
    record = parse_record(data)
    assert list(record.features) == list(order)
    assert record.end == len(data) == record_size(record.payload_length)
    assert record.payload_offset == HEADER_BYTES
    assert bytes(bytes_value(data, record.features["x"])) == volume.tobytes()
    y = float_values(data, record.features["y"])
    assert y.dtype == np.float32 and np.array_equal(y, LABELS)
    assert record.features["y"] == Feature("float", record.features["y"].offset, 16, 4, True,
                                           record.features["y"].span)


def test_round_trip_with_extra_and_int64_features() -> None:
    steps = np.array([-5, 0, 1, 2**40, -(2**63), 2**63 - 1], dtype=np.int64)
    data = frame_record(encode_example({"note": b"hello", "x": memoryview(cube()),
                                        "step": steps, "y": [0.5, 1.5], "ids": [3, -4]}))
    features = parse_record(data).features
    assert set(features) == {"note", "x", "step", "y", "ids"}
    assert bytes(bytes_value(data, features["note"])) == b"hello"
    assert bytes(bytes_value(data, features["x"])) == cube().tobytes()
    assert np.array_equal(int64_values(data, features["step"]), steps)
    assert np.array_equal(int64_values(data, features["ids"]), [3, -4])
    assert np.array_equal(float_values(data, features["y"]), [0.5, 1.5])
    assert features["step"].kind == "int64" and features["step"].count == len(steps)


def test_unpacked_scalars_unknown_fields_and_repeated_features() -> None:
    floats = b"".join(varint(1 << 3 | 5) + struct.pack("<f", v) for v in (1.0, -2.0))
    ints = b"".join(varint(1 << 3 | 0) + varint(v) for v in (7, -1))
    unknown = (varint(9 << 3 | 0) + varint(300) + varint(10 << 3 | 1) + bytes(8)
               + varint(11 << 3 | 5) + bytes(4) + field(12, b"skip me"))
    float_list = field(2, unknown + floats + field(1, struct.pack("<f", 3.0)))
    payload = (unknown + field(1, entry("y", float_list) + unknown)
               + field(1, entry("n", unknown + field(3, ints))) + unknown)
    data = frame_record(payload)
    features = parse_record(data).features
    assert not features["y"].packed and features["y"].count == 3
    assert np.array_equal(float_values(data, features["y"]), [1.0, -2.0, 3.0])
    assert np.array_equal(int64_values(data, features["n"]), [7, -1])
    example_pb2 = pytest.importorskip("tfrecord.example_pb2")
    parsed = example_pb2.Example.FromString(payload).features.feature
    assert list(parsed["y"].float_list.value) == [1.0, -2.0, 3.0]
    assert list(parsed["n"].int64_list.value) == [7, -1]


def test_last_map_entry_wins_and_a_kindless_feature_removes_the_key() -> None:
    one, two = field(1, field(1, b"a")), field(1, field(1, b"bb"))
    payload = field(1, entry("k", one) + entry("k", two) + entry("gone", one)
                    + entry("gone", b""))
    features = parse_example(payload, 0, len(payload))
    assert set(features) == {"k"} and bytes(bytes_value(payload, features["k"])) == b"bb"


def test_records_back_to_back_and_other_buffer_types() -> None:
    first = frame_record(encode_example({"y": LABELS}))
    second = frame_record(encode_example({"y": LABELS * 2}))
    for buffer in (first + second, bytearray(first + second),
                   np.frombuffer(first + second, np.uint8)):
        record = parse_record(buffer, offset=len(first))
        assert record.end == len(first) + len(second)
        assert np.array_equal(float_values(buffer, record.features["y"]), LABELS * 2)


def test_empty_example_and_empty_lists() -> None:
    assert parse_example(b"", 0, 0) == {}
    assert parse_record(frame_record(b"")).features == {}
    data = frame_record(encode_example({"e": [], "b": b""}))
    features = parse_record(data).features
    assert float_values(data, features["e"]).shape == (0,)
    assert bytes(bytes_value(data, features["b"])) == b""


def test_encode_rejects_what_is_not_bytes_floats_or_ints() -> None:
    with pytest.raises(TypeError, match="dtype"):
        encode_example({"s": ["text"]})


def test_accessors_refuse_the_wrong_kind_or_count() -> None:
    payload = field(1, entry("two", field(1, field(1, b"a") + field(1, b"b")))) + encode_example(
        {"y": LABELS})
    features = parse_example(payload, 0, len(payload))
    assert features["two"].count == 2
    with pytest.raises(TFRecordError, match="one bytes value"):
        bytes_value(payload, features["two"])
    with pytest.raises(TFRecordError, match="one bytes value"):
        bytes_value(payload, features["y"])
    with pytest.raises(TFRecordError, match="expected a float"):
        float_values(payload, features["two"])
    with pytest.raises(TFRecordError, match="expected a int64"):
        int64_values(payload, features["y"])


# --- the independent encoder and decoder ------------------------------------------------

def test_parses_a_file_written_by_the_tfrecord_package(tmp_path: Path) -> None:
    writer = pytest.importorskip("tfrecord.writer")
    volume = cube(seed=1)
    path = tmp_path / "sample.tfrecord"
    w = writer.TFRecordWriter(str(path))
    w.write({"x": (volume.tobytes(), "byte"), "y": (LABELS, "float")})
    w.close()
    features, x, labels = parse_mapped(path, verify_payload=True)
    assert np.array_equal(x, volume.ravel()) and np.array_equal(labels, LABELS)
    assert features["x"].count == 1 and features["y"].packed


def test_the_tfrecord_package_reads_a_file_written_here(tmp_path: Path) -> None:
    reader = pytest.importorskip("tfrecord.reader")
    writer = pytest.importorskip("tfrecord.writer")
    volume = cube(seed=2)
    payload = encode_example({"x": volume.tobytes(), "y": LABELS})
    data = write(tmp_path / "sample.tfrecord", frame_record(payload)).read_bytes()
    (loaded,) = list(reader.tfrecord_loader(str(tmp_path / "sample.tfrecord"), None))
    assert loaded["x"] == volume.tobytes() and np.array_equal(loaded["y"], LABELS)
    masked = writer.TFRecordWriter.masked_crc  # the reader above checks no CRC
    assert data[8:12] == masked(data[:8]) and data[-4:] == masked(payload)


# --- no copy of the big value -----------------------------------------------------------

def test_the_feature_offset_points_into_the_mapped_file(tmp_path: Path) -> None:
    volume = cube(width=16)
    path = write(tmp_path / "s.tfrecord", frame_record(encode_example({"x": volume.tobytes(),
                                                                        "y": LABELS})))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        x = parse_record(mapped, verify_payload=False).features["x"]
        block = np.frombuffer(mapped, dtype="<i2", count=volume.size, offset=x.offset)
        assert np.array_equal(block.reshape(volume.shape), volume)
        del block
    # the mmap closed cleanly above: parsing left no export of it behind


def test_bytes_value_is_a_view_of_the_buffer() -> None:
    buffer = np.frombuffer(frame_record(encode_example({"x": cube().tobytes()})), np.uint8)
    view = bytes_value(buffer, parse_record(buffer).features["x"])
    assert np.shares_memory(np.frombuffer(view, np.uint8), buffer)


def test_an_error_leaves_no_export_of_the_mapped_file(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.tfrecord", b"\0" * 20)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with pytest.raises(TFRecordError) as caught:
            parse_record(mapped)
        mapped.close()  # BufferError if the traceback still held a view
    assert "CRC" in str(caught.value)


# --- the real CosmoFlow size ------------------------------------------------------------

@pytest.mark.parametrize("order", [("x", "y"), ("y", "x")])
def test_an_uncompressed_cosmoflow_record_has_the_mlperf_size(order: tuple[str, str]) -> None:
    values = {"x": bytes(COSMOFLOW_CUBE_BYTES), "y": [0.0] * 4}
    payload = encode_example({key: values[key] for key in order})
    assert record_size(len(payload)) == COSMOFLOW_FILE_BYTES
    writer = pytest.importorskip("tfrecord.writer")
    reference = writer.TFRecordWriter.serialize_tf_example(
        {"x": (values["x"], "byte"), "y": (values["y"], "float")})
    assert len(reference) == len(payload)


# --- damage -----------------------------------------------------------------------------

def damaged_record() -> tuple[bytearray, Feature]:
    data = bytearray(frame_record(encode_example({"x": cube().tobytes(), "y": LABELS})))
    return data, parse_record(data).features["x"]


@pytest.mark.parametrize("position", [0, 3, 7, 8, 11])
def test_a_flip_in_the_length_or_its_crc_is_caught(position: int) -> None:
    data, _ = damaged_record()
    data[position] ^= 0x10
    with pytest.raises(TFRecordError, match="length CRC mismatch"):
        parse_record(data, verify_payload=False)


def test_a_flip_in_the_cube_is_caught_only_by_the_payload_crc() -> None:
    data, x = damaged_record()
    data[x.offset + 100] ^= 0x01
    with pytest.raises(TFRecordError, match="payload CRC mismatch"):
        parse_record(data)
    assert parse_record(data, verify_payload=False).features["x"] == x


def test_a_flip_in_the_footer_is_a_payload_crc_mismatch() -> None:
    data, _ = damaged_record()
    data[-1] ^= 0x80
    with pytest.raises(TFRecordError, match="payload CRC mismatch"):
        parse_record(data)


@pytest.mark.parametrize("damage, problem", [
    (lambda d, x: d.__setitem__(HEADER_BYTES, 0x0B), "wire type 3"),  # Example's first tag
    (lambda d, x: d.__setitem__(x.offset - 1, 0x7F), "needs 16256 bytes"),  # x's length
    (lambda d, x: d.__setitem__(x.offset - 3, 0x09), "wire type 1, expected 2"),  # x's tag
])
def test_a_flip_in_the_structure_is_caught_without_the_payload_crc(damage, problem) -> None:
    data, x = damaged_record()
    damage(data, x)
    with pytest.raises(TFRecordError, match=f"not an Example: .*{problem}"):
        parse_record(data, verify_payload=False)


@pytest.mark.parametrize("keep", [0, 5, HEADER_BYTES - 1, HEADER_BYTES + 100, -FOOTER_BYTES,
                                  -1])
def test_a_truncated_record_is_caught(keep: int) -> None:
    data, _ = damaged_record()
    with pytest.raises(TFRecordError, match="truncated"):
        parse_record(bytes(data[:keep]), verify_payload=False)


def test_a_field_one_byte_longer_than_its_message_is_refused() -> None:
    """The Example's one field ends at the payload's end: cut the message one byte short
    (the byte is still in the buffer) and that field overruns it."""
    payload = encode_example({"x": b"abc"})
    assert parse_example(payload, 0, len(payload))["x"].length == 3
    with pytest.raises(TFRecordError, match="needs .* bytes, only .* left in its message"):
        parse_example(payload, 0, len(payload) - 1)


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_with_good_crcs_are_not_an_example(seed: int) -> None:
    junk = np.random.default_rng(seed).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    for payload in (junk, b"\xff" * 20, b"\x0a\x05ab"):
        with pytest.raises(TFRecordError, match="not an Example"):
            parse_record(frame_record(payload))


def test_an_offset_outside_the_buffer_is_refused() -> None:
    with pytest.raises(TFRecordError, match="outside"):
        parse_record(b"abc", offset=4)
