"""The MLPerf HPC CosmoFlow TFRecord sample, read and written without TensorFlow.

One sample per ``.tfrecord`` file (or per record of a file of several, addressed as
``<file>#<k>``: :func:`record_address`): one record (``tfrecord_codec``) whose
``Example`` has feature ``x``, the raw little-endian int16 cube ``[W, W, W, 4]`` (D, H,
W, C; W = 128 in MLPerf; older preparations wrote it as a packed float_list of float32
counts, read as a float32 dataset), and feature ``y``, the 4 float32 labels (absent:
unlabelled).  MLPerf v1.0 files are whole-file gzip streams under the same name (magic
bytes ``1f 8b``); v0.7 files are plain.

- A plain file is memory-mapped and the ``x`` bytes are addressed where they lie, so the
  direct reader reads only a rank's hyperslab.  Only the record's framing is parsed per
  read; the payload CRC, which needs every byte, is checked when the file is probed (once
  per dataset, building the label table), staged or converted.
- A gzip file cannot be sliced: every read inflates the whole file (16 MiB per MLPerf
  sample).  ``cosmotrain preload`` stages such files decompressed onto node-local storage
  so a training loop never inflates; without staging the job says so once (``open.py``).
"""

from __future__ import annotations

import functools
import gzip
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from cosmotrain.files.atomic import write_bytes_atomically
from cosmotrain.data.dataset import cache
from cosmotrain.data.formats.tfrecord_codec import (FeatureValue, Record, TFRecordError,
                                                     bytes_value, encode_example, float_values,
                                                     frame_record, parse_record)
from cosmotrain.data.formats.read_errors import GZIP_ERRORS, named_on_failure
from cosmotrain.data.formats.sample import (CHANNELS_LAST, NUM_CHANNELS, TFRECORD, Box,
                                             SampleNames, VolumeInfo, check_expected, check_finite,
                                             checked_labels, copy_block, encode_counts, to_layout)
from cosmotrain.errors import DataError, UserError

GZIP_MAGIC = b"\x1f\x8b"
SUFFIXES = (".tfrecord", ".tfrecords")
VOLUME_FEATURE, LABEL_FEATURE = "x", "y"
ITEM = np.dtype("<i2")  # x holds little-endian int16 counts
FLOAT_ITEM = np.dtype("<f4")  # or, in older preparations, a packed float_list of counts
FORMAT_HINT = ("expected one TFRecord Example per file (plain or gzip) with feature 'x' "
               "(bytes: int16 [W, W, W, 4], or a packed float_list of as many float32) "
               "and feature 'y' (4 floats), as MLPerf HPC CosmoFlow writes them")
GZIP_LEVEL = 6


NAMES = SampleNames(SUFFIXES)
sample_name = NAMES.sample_name
RECORD_MARK = "#"  # ``<file>#<k>``: record k of a file holding several


def record_address(path: Path | str) -> tuple[Path, int | None]:
    """``(file, k)`` of the sample address ``<file>#<k>`` (record ``k``, from 0, of a file
    of several records, as the scan lists them); ``(path, None)`` for a file name."""
    path = Path(path)
    stem, mark, index = path.name.rpartition(RECORD_MARK)
    if mark and index.isdigit() and NAMES.is_sample_name(stem):
        return path.with_name(stem), int(index)
    return path, None


def sample_file(path: Path | str) -> Path:
    """The file holding the sample at ``path`` (an address's file, else ``path``)."""
    return record_address(path)[0]


def record_addresses(relpath: str, count: int) -> list[str]:
    """The addresses of the ``count`` records of the file ``relpath``."""
    return [f"{relpath}{RECORD_MARK}{k}" for k in range(count)]


def is_sample_name(name: str) -> bool:
    return NAMES.is_sample_name(record_address(name)[0].name)


def sample_stem(name: str) -> str:
    """A sample's stem: the file's, with ``_<k>`` (3 digits at least) for record ``k``."""
    file, index = record_address(name)
    stem = NAMES.sample_stem(file.name)
    return stem if index is None else f"{stem}_{index:03d}"


def record_count(path: Path) -> int:
    """How many records the file ``path`` holds (framing only; gzip: inflated first)."""
    with _opened(path) as buffer:
        return len(_offsets(path, buffer))


def is_gzip(path: Path) -> bool:
    """True when the file (holding the sample at ``path``) is a whole-file gzip stream
    (MLPerf v1.0), by its magic bytes."""
    path = sample_file(path)
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == GZIP_MAGIC
    except OSError as err:
        raise DataError(path, f"cannot be read: {err}", FORMAT_HINT) from err


def write_sample(path: Path, volume_cdhw: np.ndarray, labels: np.ndarray, *,
                 layout: str = CHANNELS_LAST, dtype: str = "int16", where: str = "--out",
                 gzip: bool = False) -> Path:
    """Write one sample as a one-record TFRecord file, atomically; ``gzip`` compresses the
    whole file as MLPerf v1.0 does (deterministic bytes: no timestamp in the header)."""
    if layout != CHANNELS_LAST or dtype != "int16":
        raise UserError(f"TFRecord samples hold int16 channels-last cubes (MLPerf's "
                        f"format), not {dtype} {layout}: write hdf5 or npy instead")
    cube = np.ascontiguousarray(encode_counts(to_layout(volume_cdhw, CHANNELS_LAST), "int16"),
                                dtype=ITEM)
    features: dict[str, FeatureValue] = {VOLUME_FEATURE: cube.tobytes()}
    labels = np.asarray(labels, dtype=np.float32)
    if not np.isnan(labels).all():
        features[LABEL_FEATURE] = labels
    record = frame_record(encode_example(features))
    if gzip:
        record = _gzip(record)
    return write_bytes_atomically(Path(path), record, where)


def probe(path: Path, expect: VolumeInfo | None = None) -> tuple[VolumeInfo, np.ndarray]:
    """Header and labels of one file, every CRC verified (reads the whole file once)."""
    with _opened(path) as buffer:
        record = _record(path, buffer, verify=True)
        info = _volume_info(path, buffer, record)
        labels = _labels(path, buffer, record)
    if expect is not None:
        check_expected(path, info, expect)
    return info, labels


def read_block(path: Path, expect: VolumeInfo, box: Box | None = None,
               origin: tuple[int, int, int] = (0, 0, 0),
               channels: slice = slice(0, NUM_CHANNELS),
               out: np.ndarray | None = None) -> np.ndarray:
    """One hyperslab (int16, C, D, H, W) read where ``x`` lies in the mapped file."""
    with _opened(path) as buffer:
        record = _record(path, buffer, verify=False)
        info = _volume_info(path, buffer, record)
        check_expected(path, info, expect)
        feature = record.features[VOLUME_FEATURE]
        item = np.dtype(info.dtype).newbyteorder("<")
        volume = np.frombuffer(buffer, dtype=item, count=feature.length // item.itemsize,
                               offset=feature.offset).reshape(info.shape)
        block = copy_block(path, volume, info, box, origin, channels, out)
        del volume  # the map cannot close while a view of it is alive
    if block.dtype.kind == "f":
        check_finite(path, block)
    return block


def inflate(path: Path) -> bytes:
    """The decompressed bytes of a gzip file; a truncated or damaged stream is a
    :class:`DataError` naming the file."""
    with named_on_failure(path, GZIP_ERRORS, "download or copy the file again",
                          "is a damaged or truncated gzip stream"):
        return gzip.decompress(Path(path).read_bytes())


@contextmanager
def _opened(path: Path) -> Iterator[bytes | mmap.mmap]:
    """The bytes of the file holding ``path`` (a file or a record's address): inflated
    (gzip) or a read-only memory map (plain)."""
    path = sample_file(path)
    if is_gzip(path):
        yield inflate(path)
        return
    try:
        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
        raise DataError(path, f"cannot be read: {err}", FORMAT_HINT) from err
    try:
        yield mapped
    finally:
        mapped.close()


def _record(path: Path, buffer: bytes | mmap.mmap, verify: bool) -> Record:
    """The sample's record: the file's only one, or record ``k`` of an address."""
    index = record_address(path)[1]
    offset = 0 if index is None else _offset_of(path, index)
    try:
        record = parse_record(buffer, verify_payload=verify, offset=offset)
    except TFRecordError as err:
        raise DataError(path, str(err), FORMAT_HINT) from err
    if index is None and record.end != len(buffer):
        count = len(_offsets(path, buffer))
        raise DataError(path, f"holds {count} records, not one", f"address them as "
                        f"'{Path(path).name}{RECORD_MARK}0' to '{RECORD_MARK}{count - 1}' "
                        f"(a scan of the directory lists them so)")
    if VOLUME_FEATURE not in record.features:
        raise DataError(path, f"has no feature '{VOLUME_FEATURE}' (it has "
                        f"{', '.join(sorted(record.features)) or 'none'})", FORMAT_HINT)
    return record


def _offsets(path: Path, buffer: bytes | mmap.mmap) -> list[int]:
    """Where each record of the file begins."""
    return list(_walk(path, buffer))


def _offset_of(path: Path, index: int) -> int:
    """Where record ``index`` begins, from the file's offsets (:func:`_file_offsets`)."""
    file = sample_file(path)
    offsets = _file_offsets(str(file), *cache.file_stat(file))
    if index >= len(offsets):
        raise DataError(path, f"has {len(offsets)} record(s), no record {index}",
                        "list only the records the file holds (rescan it)")
    return offsets[index]


@functools.lru_cache(maxsize=4096)
def _file_offsets(file: str, size: int, mtime_ns: int) -> tuple[int, ...]:
    """The record offsets of ``file``, walked once per process for each size and
    modification time it has (a memo: a reader comes back to a file for each of its
    records, and walking 63 records' framing cost 2.4 ms a read)."""
    with _opened(Path(file)) as buffer:
        return tuple(_walk(Path(file), buffer))


def _walk(path: Path, buffer: bytes | mmap.mmap) -> Iterator[int]:
    """The records' offsets, one after the other (framing walked, payloads not read)."""
    offset, number = 0, 0
    while offset < len(buffer):
        yield offset
        try:
            offset = parse_record(buffer, verify_payload=False, offset=offset).end
        except TFRecordError as err:
            raise DataError(path, f"record {number}: {err}", FORMAT_HINT) from err
        number += 1


def _volume_info(path: Path, buffer: bytes | mmap.mmap, record: Record) -> VolumeInfo:
    """The cube's shape and dtype from ``x``: ``W**3 * 4`` int16 values (bytes, MLPerf) or
    float32 values (a packed float_list, as older preparations wrote them)."""
    feature = record.features[VOLUME_FEATURE]
    try:
        if feature.kind == "float" and (feature.packed or feature.count == 0):
            item, length = FLOAT_ITEM, feature.length if feature.count else 0
        else:
            item, length = ITEM, len(bytes_value(buffer, feature))
    except TFRecordError as err:
        raise DataError(path, f"feature '{VOLUME_FEATURE}': {err}", FORMAT_HINT) from err
    voxels = length // (item.itemsize * NUM_CHANNELS)
    width = round(voxels ** (1 / 3)) if voxels > 0 else 0
    if width < 1 or width ** 3 * NUM_CHANNELS * item.itemsize != length:
        kind = "an int16" if item == ITEM else "a float32"
        raise DataError(path, f"feature '{VOLUME_FEATURE}' holds {length} bytes, not "
                        f"{kind} cube [W, W, W, 4] (128^3 x 4 is "
                        f"{128 ** 3 * 4 * item.itemsize} bytes)", FORMAT_HINT)
    return VolumeInfo((width, width, width, NUM_CHANNELS), item.name, CHANNELS_LAST,
                      TFRECORD)


def _labels(path: Path, buffer: bytes | mmap.mmap, record: Record) -> np.ndarray:
    feature = record.features.get(LABEL_FEATURE)
    if feature is None:
        return checked_labels(path, None, f"feature '{LABEL_FEATURE}'")
    try:
        values = float_values(buffer, feature)
    except TFRecordError as err:
        raise DataError(path, f"feature '{LABEL_FEATURE}': {err}", FORMAT_HINT) from err
    return checked_labels(path, values, f"feature '{LABEL_FEATURE}'")


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0)
