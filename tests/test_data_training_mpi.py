"""Training from the readers: preload and direct, at 1 and 4 ranks, end at the same parameters.

The tiny model on synthetic universes (16^3 files cut into 8^3 samples), SGD with
momentum, 4 steps across an epoch boundary (batches of 6, 6 and 4).  At one layout the two
readers deliver identical blocks, so the runs must agree exactly; across layouts (1 rank
against N2D2 and C2D2 on 4, where the input is also cut along its channels) to float32
rounding: every parameter tensor within 1e-5 (relative norm of the difference), as are
the losses.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import abort_on_error

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.load import load_config
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.data.synthetic.datagen import generate_dataset
from cosmotrain.data.readers.job_readers import make_reader, open_dataset
from cosmotrain.data.readers.placement import BlockPlacement
from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.nn.module import Context
from cosmotrain.engine.step import hybrid_step_from_config

STEPS = 4
RTOL = 1e-5
COMMON = ["model.name=tiny", "model.width=8", "train.batch_size=6", "train.seed=2",
          "optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9"]
CASES = [  # (ranks, reader, parallel overrides)
    (1, "preload", []), (1, "direct", []),
    (4, "preload", ["parallel.sample=2", "parallel.depth=2"]),
    (4, "direct", ["parallel.sample=2", "parallel.depth=2"]),
    (4, "preload", ["parallel.channel=2", "parallel.depth=2"]),
    (4, "direct", ["parallel.channel=2", "parallel.depth=2"]),
]


def train(comm, root: Path, reader_kind: str, parallel: list[str]) -> dict:
    cfg = load_config(None, [*COMMON, f"data.path={root}", f"data.reader={reader_kind}",
                             *parallel])
    grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    width = cfg.model.width
    dist, coord = step.model.input_distribution(
        (cfg.train.batch_size, cfg.model.channels, width, width, width))
    reader = make_reader(cfg, open_dataset(cfg, comm), "train", comm,
                         BlockPlacement.from_distribution(dist, coord))
    losses = []
    for it in range(STEPS):
        epoch, index = divmod(it, reader.batches_per_epoch)
        batch = reader.batch(epoch, index)
        out = step.gradients(batch.x, batch.targets, Context(step=it, seed=cfg.train.seed))
        step.update()
        losses.append(out.loss)
    reader.close()
    params = step.model.full_parameters()  # collective: channel-split blocks gathered
    grid.free()
    return {"losses": np.array(losses), "params": params,
            "batches": reader.batches_per_epoch}


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_preload_and_direct_train_to_the_same_parameters() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _parallel.set_num_workers(1)
    root = Path(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None))
    if world.rank == 0:
        generate_dataset(root, 3, 16, 5, val_fraction=0.34)  # 2 train files: 16 samples
    world.Barrier()
    runs = {}
    for wave in ([CASES[0], CASES[1]], *([case] for case in CASES[2:])):
        color = 0 if len(wave) == 1 else world.rank if world.rank < 2 else None
        comm = world.Split(MPI.UNDEFINED if color is None else color, world.rank)
        if comm != MPI.COMM_NULL:
            ranks, kind, parallel = wave[0] if len(wave) == 1 else wave[world.rank]
            result = train(comm, root, kind, parallel)
            if comm.Get_rank() == 0:
                runs[(ranks, kind, "".join(parallel))] = result
            comm.Free()
    runs = {k: v for part in world.allgather(runs) for k, v in part.items()}
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(root)
    ref = runs[(1, "preload", "")]
    assert ref["batches"] == 3  # batches of 6, 6, 4: the 4 steps cross into epoch 1
    assert len(runs) == len(CASES)
    for ranks, kind, layout in runs:  # at one layout, the two readers agree exactly
        twin = runs[(ranks, "direct", layout)]["params"]
        assert all(np.array_equal(twin[k], runs[(ranks, "preload", layout)]["params"][k])
                   for k in ref["params"])
    errors = {f"{key} {name}": relative(run["params"][name], value)
              for key, run in runs.items() for name, value in ref["params"].items()}
    errors.update({f"{key} losses": relative(run["losses"], ref["losses"])
                   for key, run in runs.items()})
    bad = {key: err for key, err in errors.items() if not err <= RTOL}
    assert not bad, bad
