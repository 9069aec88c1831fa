"""Checksums of checkpoints: CRC-32 per dataset and over the file's whole listing.

Why CRC-32 (``zlib``): it catches damage (a failing disk, a torn copy, bytes flipped by a
file system), not tampering, at about 3.6 GB/s here against 0.8 GB/s for blake2b, from the
standard library.  Each dataset carries the CRC of its bytes (the config: of its UTF-8
text); the root carries the CRC of a canonical listing of every group, dataset, dtype,
shape and attribute, so a changed scalar, counter or entry is caught too.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import h5py
import numpy as np

CHECKSUM_ATTR = "checksum"  # root attribute: CRC-32 of the listing of everything else
CRC_ATTR = "crc32"  # dataset attribute: CRC-32 of the dataset's data bytes


def crc32_of(value: Any) -> int:
    """CRC-32 of an array's bytes as stored (C order), or of a string's UTF-8."""
    if isinstance(value, str):
        return zlib.crc32(value.encode("utf-8"))
    flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    return zlib.crc32(flat)


def content_checksum(f: h5py.File) -> int:
    """CRC-32 of a canonical listing of ``f``: every group and dataset by path, each
    dataset's dtype and shape, every attribute but the root's ``checksum`` (so each
    dataset's ``crc32`` too).  Reads metadata only, no array data."""
    entries = [_entry("/", f, root=True)]
    f.visititems(lambda name, obj: entries.append(_entry(name, obj)))
    return zlib.crc32("\n".join(sorted(entries)).encode("utf-8"))


def _entry(name: str, obj: Any, root: bool = False) -> str:
    attrs = sorted([key, type(value).__name__, value]
                   for key, value in read_scalars(obj).items()
                   if not (root and key == CHECKSUM_ATTR))
    if isinstance(obj, h5py.Dataset):
        return json.dumps([name, "dataset", obj.dtype.str, list(obj.shape), attrs],
                          default=_plain)
    return json.dumps([name, "group", attrs], default=_plain)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else repr(value)


def read_scalars(node: h5py.Group) -> dict[str, Any]:
    """Attributes back as Python scalars (h5py returns numpy scalars)."""
    return {key: (value.item() if isinstance(value, np.generic) else value)
            for key, value in node.attrs.items()}
