"""Read bandwidth of the direct and preload readers, and I/O wait per step with prefetch.

    [mpiexec -n P] python benchmarks/bench_io.py [--dir DIR] [--samples N] [--width W]
        [--batch B] [--ways N,C,D,H,W] [--epochs E] [--compute-ms T]
        [--compute sleep|numpy] [--cold] [--only bandwidth|wait] [--repeats R]
        [--format hdf5|tfrecord|npy] [--gzip]

Generates a synthetic dataset with ``cosmotrain datagen`` into ``--dir`` (default
``/tmp/cosmotrain-bench-io-W<W>[-<format>[-gzip]]``) in ``--format`` unless it is there, then, with the readers of
``cosmotrain.data`` on the ranks of the job (rank r holds block r of ``--ways``, row-major):

* bandwidth: ``--epochs`` epochs of batches with no compute, after one warm-up epoch.
  *direct*: the files' bytes over the time spent reading them (h5py hyperslab reads),
  and the float32 bytes delivered (transformed) over the time the caller waited.
  *preload*: the preload pass (files -> store) and the per-step delivery (store ->
  Alltoallw -> transformed block).
* wait: the direct reader with ``--compute-ms`` of simulated compute per step, prefetch
  off and on: the mean time per step spent waiting for data over ``--epochs`` epochs
  after a warm-up epoch (whose end prefetches the first measured batch).
  ``--compute numpy`` keeps one core busy with BLAS (GIL released, like a training
  step); ``sleep`` is idle time.

``--cold`` evicts the dataset's files from the page cache (``posix_fadvise DONTNEED``,
no root needed) before the preload pass and before every measured epoch; without it the
files are usually cached (they were just written or read).
Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np
from mpi4py import MPI

from cosmotrain.config.load import load_config
from cosmotrain.data.readers.direct import DirectReader
from cosmotrain.data.readers.job_readers import make_reader, open_dataset
from cosmotrain.data.readers.placement import BlockPlacement

MIB = float(1 << 20)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ways", default="1,1,1,1,1")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--compute-ms", type=float, default=500.0)
    parser.add_argument("--compute", choices=("sleep", "numpy"), default="numpy")
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--format", choices=("hdf5", "tfrecord", "npy"), default="hdf5")
    parser.add_argument("--gzip", action="store_true", help="tfrecord: whole-file gzip")
    parser.add_argument("--only", choices=("bandwidth", "wait"), default=None)
    parser.add_argument("--repeats", type=int, default=3,
                        help="measure this many times and report the median of each figure")
    return parser.parse_args()


def ensure_dataset(comm: Any, root: Path, samples: int, width: int,
                   format_args: list[str]) -> None:
    """``cosmotrain datagen`` on rank 0 when the dataset is missing."""
    if comm.Get_rank() == 0 and not (root / "manifest.json").is_file():
        cmd = [sys.executable, "-m", "cosmotrain", "datagen", "--out", str(root),
               "--samples", str(samples), "--width", str(width), "--seed", "7",
               "--val-fraction", "0", *format_args]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    comm.Barrier()


def evict(root: Path) -> None:
    """Drop the dataset's pages from the page cache (next reads come from the disk)."""
    for path in root.glob("*/sample_*"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def placement(comm: Any, ways: tuple[int, ...], width: int) -> BlockPlacement:
    coords = list(itertools.product(*(range(w) for w in ways)))
    return BlockPlacement(ways, coords[comm.Get_rank() % len(coords)], 4, width)


def config(args: argparse.Namespace, root: Path, reader: str, prefetch: bool) -> Any:
    return load_config(None, [f"data.path={root}", f"model.width={args.width}",
                              f"train.batch_size={args.batch}", f"data.reader={reader}",
                              f"data.prefetch={prefetch}"])


def total(comm: Any, value: float) -> float:
    return comm.allreduce(value)


def slowest(comm: Any, value: float) -> float:
    return comm.allreduce(value, op=MPI.MAX)


def bandwidth(comm: Any, args: argparse.Namespace, root: Path, where: BlockPlacement
              ) -> dict[str, float]:
    """MiB/s of both readers over ``args.epochs`` epochs with no compute."""
    out = {}
    for kind in ("direct", "preload"):
        if args.cold:
            evict(root)
        comm.Barrier()
        cfg = config(args, root, kind, prefetch=False)
        reader = make_reader(cfg, open_dataset(cfg, comm), "train", comm, where)
        for _ in reader.epoch(0):  # warm-up: first touches of fresh memory, imports
            pass
        reader.stats.reset()
        delivered = 0
        for epoch in range(1, 1 + args.epochs):
            if args.cold:
                evict(root)  # every epoch reads from the disk, not the page cache
            for batch in reader.epoch(epoch):
                delivered += batch.x.data.nbytes
        stats = reader.stats
        reader.close()
        wait = slowest(comm, stats.wait_seconds)
        out[f"{kind} delivered MiB/s"] = total(comm, delivered) / MIB / wait
        out[f"{kind} s/batch"] = wait / stats.batches
        if kind == "direct":
            out["direct file read MiB/s"] = total(comm, stats.bytes_read) / MIB / \
                slowest(comm, stats.read_seconds)
        else:
            out["preload pass MiB/s"] = total(comm, stats.load_bytes) / MIB / \
                slowest(comm, stats.load_seconds)
            out["preload pass s"] = slowest(comm, stats.load_seconds)
            out["preload received MiB/batch/rank"] = stats.bytes_received / MIB / stats.batches
    return out


def compute(seconds: float, how: str, work: np.ndarray) -> None:
    """``seconds`` of simulated compute: BLAS products (GIL released) or idle."""
    if how == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.dot(work, work)


def wait_per_step(comm: Any, args: argparse.Namespace, root: Path, where: BlockPlacement
                  ) -> dict[str, float]:
    """Mean seconds per step waiting for data, prefetch off and on."""
    out = {}
    work = np.random.default_rng(0).random((384, 384), dtype=np.float32)
    for prefetch in (False, True):
        if args.cold:
            evict(root)
        comm.Barrier()
        cfg = config(args, root, "direct", prefetch)
        reader = DirectReader(cfg, open_dataset(cfg, comm), "train", comm, where)
        for epoch in range(1 + args.epochs):  # epoch 0 warms up (and prefetches epoch 1)
            if epoch == 1:
                reader.stats.reset()
            if epoch >= 1 and args.cold:
                evict(root)
            for batch in reader.epoch(epoch):
                compute(args.compute_ms / 1000.0, args.compute, work)
                comm.allreduce(float(batch.indices[0]))  # the step's gradient allreduce
        stats = reader.stats
        reader.close()
        label = "on" if prefetch else "off"
        out[f"prefetch {label}: wait s/step"] = slowest(comm, stats.wait_seconds / stats.batches)
        out[f"prefetch {label}: read s/batch"] = slowest(comm, stats.read_seconds / stats.batches)
    out["compute s/step"] = args.compute_ms / 1000.0
    return out


def median_of(repeats: int, measure: Any) -> dict[str, float]:
    """The median of every figure over ``repeats`` measurements (the box is shared)."""
    runs = [measure() for _ in range(repeats)]
    return {key: float(np.median([run[key] for run in runs])) for key in runs[0]}


def main() -> None:
    args = parse()
    comm = MPI.COMM_WORLD
    kind = "" if args.format == "hdf5" else f"-{args.format}" + ("-gzip" if args.gzip else "")
    root = args.dir or Path(f"/tmp/cosmotrain-bench-io-W{args.width}{kind}")
    format_args = ["--format", args.format] + (["--gzip"] if args.gzip else [])
    ensure_dataset(comm, root, args.samples, args.width, format_args)
    ways = tuple(int(w) for w in args.ways.split(","))
    where = placement(comm, ways, args.width)
    result: dict[str, Any] = {"ranks": comm.Get_size(), "ways": ways, "width": args.width,
                              "batch": args.batch, "samples": args.samples,
                              "cold": args.cold, "compute": args.compute,
                              "format": args.format + ("-gzip" if args.gzip else "")}
    if args.only in (None, "bandwidth"):
        result.update(median_of(args.repeats, lambda: bandwidth(comm, args, root, where)))
    if args.only in (None, "wait"):
        result.update(median_of(args.repeats, lambda: wait_per_step(comm, args, root, where)))
    if comm.Get_rank() == 0:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                          for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
