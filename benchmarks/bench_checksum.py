"""What verifying a sample costs: a checksum of a 16 MiB sample against reading it.

    python benchmarks/bench_checksum.py [--mib 16] [--repeat 5]

Writes one sample-sized file of random int16 counts (a 128^3 x 4 int16 CosmoFlow sample
is 16 MiB) to a temporary directory and prints one JSON object: the best of ``--repeat``
times, in milliseconds, of

* ``read``: reading the file's bytes (warm page cache: the cheapest read a job makes);
* ``crc32c``: CRC-32C of the bytes in memory (``crc32c`` package, hardware instruction);
* ``zlib_crc32``: zlib's CRC-32 of the same bytes (what staging used before);
* ``verify_file``: ``cosmotrain.data.dataset.file_sums.file_crc32c`` of the file (read + CRC-32C),

and each rate in GiB/s.  docs/PERFORMANCE.md records the figures and the decision that
follows from them (data.verify: auto).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

from cosmotrain.data.dataset.file_sums import file_crc32c


def best_ms(fn: Callable[[], Any], repeat: int) -> float:
    """The fastest of ``repeat`` calls, in milliseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = np.random.default_rng(0).integers(0, 400, args.mib << 19, dtype=np.int16).tobytes()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sample.bin"
        path.write_bytes(data)
        times = {"read": best_ms(path.read_bytes, args.repeat),
                 "crc32c": best_ms(lambda: crc32c.crc32c(data), args.repeat),
                 "zlib_crc32": best_ms(lambda: zlib.crc32(data), args.repeat),
                 "verify_file": best_ms(lambda: file_crc32c(path), args.repeat)}
    gib = len(data) / 2**30
    print(json.dumps({"mib": args.mib, "ms": {k: round(v, 2) for k, v in times.items()},
                      "gib_s": {k: round(gib / (v / 1e3), 2) for k, v in times.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
