"""Bad sample files end the whole job with exit code 2 and a message naming the file.

Each case is a real 2-rank job (this file run as a script under mpiexec, with the CLI's
error handling) in which only one rank meets the bad file while the other waits in the
next collective: the job must still end, with code 2, within the timeout.  The cases cover
a truncated file, a corrupt one, a missing dataset, a wrong shape and a wrong dtype, met
by the preload pass, by a direct read, by the direct reader's prefetch thread, and by the
manifest's label pass (each of which reaches one verdict on every rank, so the message is
printed once: tests/test_bad_input.py checks that).  The launches run concurrently to save
time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

COMMON = ["model.width=8", "train.batch_size=4", "train.seed=1"]
TIMEOUT = 90


def run_job(root: str, reader: str, prefetch: str) -> None:
    """The job: N2 over 2 ranks, two epochs with a collective per step (like training)."""
    from mpi4py import MPI

    from cosmotrain.cli import report_user_error
    from cosmotrain.config.load import load_config
    from cosmotrain.data.readers.placement import BlockPlacement
    from cosmotrain.data.readers.job_readers import make_readers, open_dataset
    from cosmotrain.errors import EXIT_USER_ERROR, UserError

    comm = MPI.COMM_WORLD
    try:
        cfg = load_config(None, [*COMMON, f"data.path={root}", f"data.reader={reader}",
                                 f"data.prefetch={prefetch}"])
        placement = BlockPlacement((comm.size, 1, 1, 1, 1), (comm.rank, 0, 0, 0, 0), 4, 8)
        readers = make_readers(cfg, open_dataset(cfg, comm), comm, placement, ["train"])
        for epoch in range(2):
            for batch in readers["train"].epoch(epoch):
                comm.allreduce(float(batch.x.data.sum()))
        readers["train"].close()
    except UserError as err:
        report_user_error(err)
        sys.exit(EXIT_USER_ERROR)


def make_dataset(root: Path) -> Path:
    from cosmotrain.data.synthetic.datagen import generate_dataset
    from cosmotrain.data.dataset.manifest import open_manifest

    generate_dataset(root, 8, 8, 3, val_fraction=0.125)  # 7 training samples, int16
    open_manifest(root, 8)  # the label cache exists: the readers meet the damage
    return root


def damage(path: Path, how: str) -> None:
    good = path.read_bytes()
    if how == "truncated":
        path.write_bytes(good[:len(good) // 2])
    elif how == "corrupt":
        path.write_bytes(b"\x13" * 512 + good[512:])
    else:
        content = {"missing key": {"unitPar": np.zeros(4, np.float32)},
                   "wrong shape": {"full": np.zeros((4, 4, 4, 4), np.int16),
                                   "unitPar": np.zeros(4, np.float32)},
                   "wrong dtype": {"full": np.zeros((8, 8, 8, 4), np.float32),
                                   "unitPar": np.zeros(4, np.float32)}}[how]
        with h5py.File(path, "w") as handle:
            for key, data in content.items():
                handle[key] = data


def second_batch_sample() -> int:
    """A sample rank 0 reads in batch 1 of epoch 0 (the prefetch thread's first read)."""
    from cosmotrain.data.readers import order

    return int(order.epoch_batches(1, 0, 7, 4)[1][0])


CASES = [  # (damage, reader, prefetch, before the label cache is built)
    ("truncated", "preload", "false", False),
    ("corrupt", "direct", "true", False),
    ("missing key", "direct", "false", False),
    ("wrong shape", "preload", "false", False),
    ("wrong dtype", "direct", "true", False),
    ("truncated", "direct", "true", True),
]


def test_bad_files_end_the_job_with_exit_2_naming_the_file(tmp_path: Path) -> None:
    from conftest import stderr_of, mpiexec, subprocess_env

    template = make_dataset(tmp_path / "template")
    victim = f"train/sample_{second_batch_sample():06d}.hdf5"
    jobs = []
    for i, (how, reader, prefetch, early) in enumerate(CASES):
        root = tmp_path / f"case{i}"
        shutil.copytree(template, root)
        if early:
            for cached in root.glob("cosmotrain-*"):
                cached.unlink()
        damage(root / victim, how)
        cmd = [mpiexec(), "-n", "2", sys.executable, __file__, str(root), reader, prefetch]
        jobs.append((how, reader, root / victim, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=subprocess_env())))
    for how, reader, path, job in jobs:
        err = stderr_of(job, f"{how} ({reader})", TIMEOUT)
        assert job.returncode == 2, f"{how} ({reader}): exit {job.returncode}\n{err}"
        assert f"cosmotrain: error: data file '{path}'" in err, f"{how} ({reader}): {err}"
        assert "Traceback" not in err, err


def test_prefetch_errors_surface_in_the_caller_and_the_thread_stops() -> None:
    from cosmotrain.data.readers.prefetch import Prefetcher
    from cosmotrain.errors import DataError

    def fail() -> int:
        raise DataError("x.hdf5", "broken")

    before = threading.active_count()
    prefetcher: Prefetcher[int] = Prefetcher()
    prefetcher.schedule(1, fail)
    with pytest.raises(DataError, match="x.hdf5"):
        prefetcher.get(1, lambda: 0)
    prefetcher.schedule(2, fail)  # never asked for: discarded with its error
    assert prefetcher.get(3, lambda: 33) == 33
    prefetcher.schedule(4, lambda: time.sleep(0.05) or 44)
    assert prefetcher.get(4, lambda: 0) == 44
    prefetcher.schedule(5, lambda: 55)
    prefetcher.close()
    assert threading.active_count() == before


if __name__ == "__main__":
    run_job(*sys.argv[1:4])
