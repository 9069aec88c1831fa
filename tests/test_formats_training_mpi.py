"""The same samples as HDF5, gzip TFRecord, plain TFRecord (ours and the PyPI ``tfrecord``
package's) and NVIDIA .npy train to the same parameters, bit for bit: both readers, on one
rank and with the depth split over two.

16^3 files cut into 8^3 sub-cubes (``model.width`` below the files' width), the tiny model,
4 SGD steps across an epoch boundary (``test_data_training_mpi.train``).
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import abort_on_error
from test_data_training_mpi import train

from cosmotrain.data.formats import interface as formats
from cosmotrain.data.copies.convert import plan_conversion, run_conversion
from cosmotrain.data.synthetic.datagen import generate_dataset
from cosmotrain.data.dataset.manifest import open_manifest
from cosmotrain.kernels.cpu import workers as _parallel

FORMATS = ("tfrecord-gzip", "tfrecord", "npy", "tfrecord-package")
LAYOUTS = {"1 rank": (1, []), "D2": (2, ["parallel.depth=2"])}


def package_fixture(reference: Path, out: Path) -> None:
    """The reference samples re-encoded by the PyPI ``tfrecord`` package (plain and gzip
    files mixed, as an independent writer would leave them); found by the scan."""
    writer = pytest.importorskip("tfrecord.writer")
    manifest = open_manifest(reference, None)
    for split, names in manifest.files.items():
        (out / split).mkdir(parents=True)
        for i, name in enumerate(names):
            volume, labels = formats.read_sample(reference / name)
            raw = np.ascontiguousarray(np.moveaxis(volume, 0, -1).astype("<i2")).tobytes()
            target = out / split / Path(name).with_suffix(".tfrecord").name
            record = writer.TFRecordWriter(str(target))
            record.write({"x": (raw, "byte"), "y": (labels.tolist(), "float")})
            record.close()
            if i % 2:
                target.write_bytes(gzip.compress(target.read_bytes()))


def make_datasets(world, base: Path) -> dict[str, Path]:
    roots = {name: base / name for name in ("hdf5", *FORMATS)}
    if world.rank == 0:
        generate_dataset(roots["hdf5"], 3, 16, 5, val_fraction=0.34)  # 16 train samples
        package_fixture(roots["hdf5"], roots["tfrecord-package"])
    world.Barrier()
    for name, format, packed in (("tfrecord-gzip", "tfrecord", True),
                                 ("tfrecord", "tfrecord", False), ("npy", "npy", False)):
        run_conversion(plan_conversion(roots["hdf5"], roots[name], format, world,
                                       gzip=packed), world)
    return roots


@pytest.mark.parallel(nprocs=2)
@abort_on_error
def test_every_format_trains_to_the_same_parameters_as_hdf5() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _parallel.set_num_workers(1)
    base = Path(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None))
    roots = make_datasets(world, base)
    cases = [(name, reader, layout) for name in ("hdf5", *FORMATS)
             for reader in ("preload", "direct") for layout in LAYOUTS]
    runs = {}
    singles = [c for c in cases if LAYOUTS[c[2]][0] == 1]
    for pair in (singles[i:i + 2] for i in range(0, len(singles), 2)):  # one per rank
        comm = world.Split(world.rank, 0)
        if world.rank < len(pair):
            name, reader, layout = pair[world.rank]
            runs[pair[world.rank]] = train(comm, roots[name], reader, LAYOUTS[layout][1])
        comm.Free()
    for case in (c for c in cases if LAYOUTS[c[2]][0] == 2):
        result = train(world, roots[case[0]], case[1], LAYOUTS[case[2]][1])
        if world.rank == 0:
            runs[case] = result
    runs = {k: v for part in world.allgather(runs) for k, v in part.items()}
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(base)
    assert len(runs) == len(cases)
    for name, reader, layout in cases:
        ref = runs[("hdf5", reader, layout)]
        got = runs[(name, reader, layout)]
        assert np.array_equal(got["losses"], ref["losses"]), (name, reader, layout)
        assert all(np.array_equal(got["params"][k], ref["params"][k]) for k in ref["params"]), \
            (name, reader, layout)
