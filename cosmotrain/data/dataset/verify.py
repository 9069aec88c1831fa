"""``data.verify``: the files of a dataset checked against the checksums its manifest records.

A staged copy, a converted dataset and a generated one record every file's size and
CRC-32C (``file_sums.py``); a downloaded directory (scanned) records none.  When a job
opens its dataset (``open.open_dataset``: ``train``, ``predict``), the ranks of each node
share out the files that node's ``manifest.json`` records (a local-shuffle staging holds
different files on each node) and each file is read and checked once; ``preload`` checks
each source file as it copies it (:func:`sums_to_check`, ``staging.copy_verified``):

- ``auto`` (default): when the manifest records checksums.  Measured (docs/PERFORMANCE.md,
  ``benchmarks/bench_checksum.py``): CRC-32C runs at about 21 GiB/s on one core, so a
  16 MiB sample costs about 1 ms beside a step of seconds; the preload reader reads every
  byte anyway, and on a node-local copy the read is from a fast disk.  With the direct
  reader on a shared file system it is one extra read of the dataset per job: choose
  ``never`` there when that costs more than it protects;
- ``always``: as ``auto``, and a dataset without checksums is refused (stage or convert it);
- ``never``: nothing is read.

A mismatch is one :class:`DataError` naming the file (the lowest failing rank's, printed
once, exit 2), met before the first step: nothing is trained on, nothing written from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cosmotrain.comm.collective import agree, on_root, self_comm, together
from cosmotrain.data.dataset import file_sums
from cosmotrain.data.dataset.unfinished import MANIFEST_NAME
from cosmotrain.errors import DataError

AUTO, ALWAYS, NEVER = "auto", "always", "never"
MODES = (AUTO, ALWAYS, NEVER)


def recorded_sums(root: Path) -> file_sums.Sums | None:
    """The checksums ``root``'s ``manifest.json`` records; None when it has none or no
    manifest (a scanned directory)."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        description = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(path, f"cannot be read as JSON: {err}", "regenerate or delete it")
    return file_sums.parse(path, description) if isinstance(description, dict) else None


def sums_to_check(root: Path, mode: str, comm: Any) -> file_sums.Sums | None:
    """The checksums ``mode`` has checked when dataset ``root`` is read whole (staging:
    each file as it is copied), read by rank 0 (collective); None for ``never`` or when
    none are recorded (``always``: refused)."""
    if mode == NEVER:
        return None
    sums = on_root(comm, lambda: recorded_sums(root))
    _require(root, mode, sums, comm)
    return sums


def _require(root: Path, mode: str, sums: file_sums.Sums | None, comm: Any) -> None:
    agree(comm, None if sums or mode != ALWAYS else
          f"data.verify is always but '{root}' records no checksums (a scanned "
          f"directory): stage it (cosmotrain preload) or convert it (cosmotrain "
          f"convert) to record them, or set data.verify: auto")


def verify_dataset(root: Path, mode: str, comm: Any) -> int:
    """Check the files of dataset ``root`` against their recorded checksums as ``mode``
    says (collective over ``comm``); how many files were checked, over the job."""
    from mpi4py import MPI

    if mode == NEVER:
        return 0
    comm = self_comm(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.Get_rank() == 0
        sums = node.bcast(together(comm, lambda: recorded_sums(root) if leader else None))
        _require(root, mode, sums, comm)
        mine = sorted(sums or {})[node.Get_rank()::node.Get_size()]
        together(comm, lambda: [file_sums.check(root, name, (sums or {})[name])
                                for name in mine])
        return int(comm.allreduce(len(mine)))
    finally:
        node.Free()
