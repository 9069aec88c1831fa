"""A small TFRecord + ``tf.train.Example`` codec for CosmoFlow files, without TensorFlow.

A CosmoFlow ``.tfrecord`` file holds one record: u64 payload length, its masked CRC32C,
the payload (an ``Example``), the payload's masked CRC32C.  The ~16 MB payload is almost
all the ``x`` cube, and the caller maps the file so a rank reads only its sub-block; so
parsing never copies or walks that value: it reads tags and varints at the few header
positions and skips values by their length, returning absolute offsets into the caller's
buffer (``bytes``, ``mmap``, numpy ``uint8``...).  The payload CRC, the one full read, is
optional so the hot path can skip it once a file has been verified.  Protobuf rules kept:
fields and map entries in any order, unknown fields (wire types 0, 1, 2, 5) skipped,
packed or unpacked scalars, the last map key or oneof wins; an entry whose ``Feature``
has no kind removes the key (the caller reports it missing).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import crc32c
import numpy as np

BufferLike = bytes | bytearray | memoryview | mmap.mmap | np.ndarray  # the buffer protocol
FeatureValue = bytes | bytearray | memoryview | np.ndarray | Sequence[float] | Sequence[int]

__all__ = [
    "MASK_DELTA", "HEADER_BYTES", "FOOTER_BYTES", "TFRecordError", "Feature", "Record",
    "masked_crc32c", "frame_record", "record_size", "parse_record", "parse_example",
    "bytes_value", "float_values", "int64_values", "encode_example",
]

MASK_DELTA = 0xA282EAD8
HEADER_BYTES = 12  # u64 length + u32 masked CRC32C of those 8 bytes
FOOTER_BYTES = 4  # u32 masked CRC32C of the payload
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_KINDS = {1: "bytes", 2: "float", 3: "int64"}  # Feature's oneof field numbers


class TFRecordError(ValueError):
    """What is wrong with a record, in words (the caller adds the file name)."""


@dataclass(frozen=True)
class Feature:
    """Where one feature's values lie in the buffer, so the caller reads only what it needs.

    ``offset``/``length``: the bytes value (``bytes``; the first one when ``count > 1``),
    the one packed run (``float``/``int64`` with ``packed``), else the whole list message.
    ``span``: the whole ``BytesList``/``FloatList``/``Int64List`` message, re-walked to
    decode values that are unpacked (or split over several runs).
    """

    kind: str
    offset: int
    length: int
    count: int
    packed: bool
    span: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class Record:
    """One framed record: where its payload lies, its features, and where the next begins."""

    payload_offset: int
    payload_length: int
    features: dict[str, Feature]
    end: int


def masked_crc32c(data: BufferLike) -> int:
    """TFRecord's masked CRC32C of a bytes-like ``data`` (masking keeps CRCs of CRCs apart)."""
    c = crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + MASK_DELTA) & _U32


def record_size(payload_length: int) -> int:
    """Bytes a record with a payload of ``payload_length`` bytes takes in a file."""
    return HEADER_BYTES + payload_length + FOOTER_BYTES


def frame_record(payload: bytes | bytearray | memoryview) -> bytes:
    """``payload`` framed as one TFRecord: length, length CRC, payload, payload CRC."""
    length = struct.pack("<Q", memoryview(payload).nbytes)
    return b"".join([length, struct.pack("<I", masked_crc32c(length)), payload,
                     struct.pack("<I", masked_crc32c(payload))])


@contextmanager
def _bytes_of(buffer: BufferLike) -> Iterator[memoryview]:
    """A flat byte view of ``buffer``, released on exit so an ``mmap`` can be closed
    afterwards (even while a ``TFRecordError`` from inside is still referenced)."""
    with memoryview(buffer) as raw, raw.cast("B") as view:
        yield view


def parse_record(buffer: BufferLike, *, verify_payload: bool = True, offset: int = 0) -> Record:
    """Check the framing of the record at ``offset`` and locate its features.

    ``verify_payload`` reads the whole payload for its CRC; skip it on the hot path once
    the file has been verified, as the rest touches only the few header bytes.
    """
    with _bytes_of(buffer) as view:
        size = len(view)
        if not 0 <= offset <= size:
            raise TFRecordError(f"offset {offset} is outside the {size}-byte buffer")
        if size - offset < HEADER_BYTES:
            raise TFRecordError(f"truncated: header needs {HEADER_BYTES} bytes at offset "
                                f"{offset}, only {size - offset} left")
        _check_crc(view, offset, offset + 8, "length")
        length = int.from_bytes(view[offset:offset + 8], "little")
        start, stop = offset + HEADER_BYTES, offset + HEADER_BYTES + length
        if stop + FOOTER_BYTES > size:
            raise TFRecordError(f"truncated: record with a {length}-byte payload needs "
                                f"{record_size(length)} bytes at offset {offset}, only "
                                f"{size - offset} left")
        if verify_payload:
            _check_crc(view, start, stop, "payload")
        features = parse_example(view, start, stop)
    return Record(start, length, features, stop + FOOTER_BYTES)


def _check_crc(view: memoryview, start: int, stop: int, what: str) -> None:
    """Compare the masked CRC32C of ``view[start:stop]`` with the u32 stored just after."""
    stored = int.from_bytes(view[stop:stop + 4], "little")
    computed = masked_crc32c(view[start:stop])
    if stored != computed:
        raise TFRecordError(f"{what} CRC mismatch: stored 0x{stored:08x}, computed "
                            f"0x{computed:08x}")


def parse_example(buffer: BufferLike, start: int, stop: int) -> dict[str, Feature]:
    """The features of the ``Example`` message in ``buffer[start:stop]`` (offsets absolute)."""
    features: dict[str, Feature] = {}
    with _bytes_of(buffer) as view:
        try:
            for number, wire, a, b in _fields(view, start, stop):
                if number == 1:  # Example.features (repeated occurrences merge)
                    _expect(wire, 2, "Example.features", a)
                    _parse_features(view, a, b, features)
        except TFRecordError as error:
            raise TFRecordError(f"not an Example: {error}") from None
    return features


def _parse_features(view: memoryview, start: int, stop: int,
                    features: dict[str, Feature]) -> None:
    """Add the map entries of one ``Features`` message to ``features`` (last key wins)."""
    for number, wire, a, b in _fields(view, start, stop):
        if number != 1:
            continue
        _expect(wire, 2, "Features.feature", a)
        key, feature = "", None
        for n, w, c, d in _fields(view, a, b):
            if n == 1:
                _expect(w, 2, "map key", c)
                try:
                    key = str(view[c:d], "utf-8")
                except UnicodeDecodeError:
                    raise TFRecordError(f"map key at offset {c} is not UTF-8") from None
            elif n == 2:
                _expect(w, 2, "map value", c)
                feature = _parse_feature(view, c, d)
        features.pop(key, None)
        if feature is not None:
            features[key] = feature


def _parse_feature(view: memoryview, start: int, stop: int) -> Feature | None:
    """The ``Feature`` in ``view[start:stop]`` (``None`` if its oneof is not set): its
    values counted and its single value or packed run located, no value read."""
    kind, span = None, (start, stop)
    for number, wire, a, b in _fields(view, start, stop):
        if number in _KINDS:
            _expect(wire, 2, f"Feature.{_KINDS[number]}_list", a)
            kind, span = _KINDS[number], (a, b)
    if kind is None:
        return None
    runs = list(_runs(view, kind, *span))
    count = sum(run[3] for run in runs)
    packed = kind != "bytes" and len(runs) == 1 and runs[0][0] == 2
    if packed or (kind == "bytes" and runs):
        return Feature(kind, runs[0][1], runs[0][2], count, packed, span)
    return Feature(kind, span[0], span[1] - span[0], count, False, span)


def _runs(view: memoryview, kind: str, start: int, stop: int
          ) -> Iterator[tuple[int, int, int, int]]:
    """``(wire, offset, length, count)`` of each ``value`` field of a list message."""
    scalar = {"bytes": 2, "float": 5, "int64": 0}[kind]
    for number, wire, a, b in _fields(view, start, stop):
        if number != 1:
            continue
        if wire != 2 or kind == "bytes":
            _expect(wire, scalar, f"{kind}_list value", a)
            yield wire, a, b - a, 1
        elif kind == "float":  # packed: 4 bytes a value
            if (b - a) % 4:
                raise TFRecordError(f"packed floats at offset {a}: {b - a} bytes")
            yield wire, a, b - a, (b - a) // 4
        else:  # packed varints: count their last bytes, all at once
            if b > a and view[b - 1] & 0x80:
                raise TFRecordError(f"packed int64s at offset {a} end inside a varint")
            last = np.frombuffer(view, np.uint8, b - a, a) < 0x80
            yield wire, a, b - a, int(np.count_nonzero(last))


def _fields(view: memoryview, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
    """``(number, wire, a, b)`` for each field of the message in ``view[start:stop]``.

    ``view[a:b]`` holds the value (for wire 2 without its length prefix); values are
    skipped by their length, never read.
    """
    pos = start
    while pos < stop:
        tag, at = _varint(view, pos, stop)
        number, wire = tag >> 3, tag & 7
        if number == 0 or number >= 1 << 29:
            raise TFRecordError(f"invalid field number {number} at offset {pos}")
        if wire == 0:
            length = _varint(view, at, stop)[1] - at
        elif wire == 2:
            length, at = _varint(view, at, stop)
        elif wire in (1, 5):  # fixed64, fixed32
            length = 8 if wire == 1 else 4
        else:
            raise TFRecordError(f"unsupported wire type {wire} at offset {pos}")
        if at + length > stop:
            raise TFRecordError(f"field {number} at offset {pos} needs {length} bytes, "
                                f"only {stop - at} left in its message")
        pos = at + length
        yield number, wire, at, pos


def _varint(view: memoryview, pos: int, stop: int) -> tuple[int, int]:
    """The base-128 varint at ``pos`` (at most 10 bytes) and the offset just past it."""
    value = shift = 0
    for i in range(pos, min(stop, pos + 10)):
        byte = view[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _U64, i + 1
        shift += 7
    raise TFRecordError(f"truncated or over-long varint at offset {pos}")


def _expect(wire: int, wanted: int, what: str, offset: int) -> None:
    """Raise unless a known field has the wire type its declaration implies."""
    if wire != wanted:
        raise TFRecordError(f"{what} near offset {offset} has wire type {wire}, "
                            f"expected {wanted}")


def bytes_value(buffer: BufferLike, feature: Feature) -> memoryview:
    """The single bytes value as a view into ``buffer`` (no copy; it keeps ``buffer``
    exported, so release it before closing an ``mmap``)."""
    if feature.kind != "bytes" or feature.count != 1:
        raise TFRecordError(f"expected one bytes value, found {feature.count} "
                            f"{feature.kind} value(s)")
    return memoryview(buffer).cast("B")[feature.offset:feature.offset + feature.length]


def float_values(buffer: BufferLike, feature: Feature) -> np.ndarray:
    """A float feature's values as a new float32 array (packed or not)."""
    _check_kind(feature, "float")
    with _bytes_of(buffer) as view:
        if feature.packed:
            data = bytes(view[feature.offset:feature.offset + 4 * feature.count])
        else:
            data = b"".join(view[a:a + 4 * n] for _, a, _, n in _runs(view, "float",
                                                                      *feature.span))
    return np.frombuffer(data, "<f4").astype(np.float32)


def int64_values(buffer: BufferLike, feature: Feature) -> np.ndarray:
    """An int64 feature's values as a new int64 array (packed or not, negatives included)."""
    _check_kind(feature, "int64")
    values: list[int] = []
    with _bytes_of(buffer) as view:
        for _, a, length, _ in _runs(view, "int64", *feature.span):
            pos = a
            while pos < a + length:
                value, pos = _varint(view, pos, a + length)
                values.append(value - (1 << 64) if value >> 63 else value)
    return np.array(values, dtype=np.int64)


def _check_kind(feature: Feature, kind: str) -> None:
    if feature.kind != kind:
        raise TFRecordError(f"expected a {kind} feature, found {feature.kind}")


def encode_example(features: Mapping[str, FeatureValue]) -> bytes:
    """An ``Example`` payload with ``features`` in the given order.

    Bytes-like values become a one-value ``bytes_list`` (joined once, not copied before);
    float arrays or sequences a packed float32 ``float_list``; integer (or bool) arrays or
    sequences a packed ``int64_list``.  An empty sequence counts as floats.
    """
    entries: list = []
    for key, value in features.items():
        entries += _ld(1, [*_ld(1, [key.encode()]), *_ld(2, _encode_feature(value))])
    return b"".join(_ld(1, entries))


def _encode_feature(value: FeatureValue) -> list:
    """The parts of the ``Feature`` message for one value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _ld(1, _ld(1, [memoryview(value).cast("B")]))
    array = np.asarray(value)
    if array.dtype.kind == "f":
        number, packed = 2, array.astype("<f4").tobytes()
    elif array.dtype.kind in "iub":
        number = 3
        packed = b"".join(_varint_bytes(int(v) & _U64) for v in array.ravel().astype(np.int64))
    else:
        raise TypeError(f"cannot encode a value of dtype {array.dtype} as a feature")
    return _ld(number, _ld(1, [packed]) if packed else [])  # as protobuf: no empty run


def _ld(number: int, parts: list) -> list:
    """``parts`` as one length-delimited field ``number``: tag, length, then the parts."""
    length = sum(memoryview(part).nbytes for part in parts)
    return [_varint_bytes(number << 3 | 2) + _varint_bytes(length), *parts]


def _varint_bytes(value: int) -> bytes:
    """``value`` (0 <= value < 2**64) as a base-128 varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
