"""Sample groups holding no sample: every mixed layout still equals one process.

A batch with fewer samples than sample groups (a last partial batch, a 1-sample
validation split, ``predict`` on a small split) leaves some groups empty: their ranks
run every layer on ``(0, C, D, H, W)`` blocks and still take part in each halo exchange,
channel/filter collective, batch-norm and loss reduction and gradient reduction.

One 4-rank launch (harness: ``equivalence.py``).  The model is planned for a batch of 4,
as the trainer plans it, then trained on batches of 1 and 3 samples and evaluated on 1:
under sample x depth / height / width / channel / filter splits (s2 x d2 ... s2 x f2),
with the spatial part run down to the flatten layer, and under s4 and s2 alone.  Each
step's predictions, loss and every gradient, the evaluation predictions (running
statistics), the running statistics and the parameters after the steps match the
one-process run (float32, ``RTOL``; harness tolerance rules).

``parallel.bn_statistics: local`` has no one-process twin; there a group that saw no
sample keeps its running statistics as they were (it has none of its own to average in)
and predicts finite values.

Without MPI: the kernels answer a batch of no sample with empty results and zero weight
gradients (still validating shapes).  End to end (subprocesses, about 15 s): ``train``
under s2 x d2 with a last batch of 1 sample and a 1-sample validation split follows the
1-rank run, and ``predict`` with ``parallel.depth=2`` on that split equals 1-rank
``predict``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, abort_on_error, mpiexec, subprocess_env
from equivalence import (everyone_failures, hybrid_short_run, make_config, ranks_of,
                         run_short_waves)

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels import conv3d, pool3d
from cosmotrain.kernels.batchnorm import bn_local_sums, bn_statistics
from cosmotrain.models import build_model

RTOL = 1e-4
SIZES, EVAL = (1, 3), 1
MODELS = {
    "tiny": ["model.name=tiny", "model.width=13", "model.dropout=0.3"],
    "cosmoflow-bn": ["model.name=cosmoflow", "model.width=18", "model.batchnorm=true"],
}
LAYOUTS = {
    "s2xd2": ["parallel.sample=2", "parallel.depth=2"],
    "s2xh2": ["parallel.sample=2", "parallel.height=2"],
    "s2xw2": ["parallel.sample=2", "parallel.width=2"],
    "s2xc2": ["parallel.sample=2", "parallel.channel=2", "parallel.channel_algorithm=x"],
    "s2xf2": ["parallel.sample=2", "parallel.filter=2", "parallel.channel_algorithm=y"],
    "s4": ["parallel.sample=4"],
    "s2": ["parallel.sample=2"],
}
DEEP = ["parallel.spatial_until=flatten"]  # spatial / channel layers down to 1-plane blocks
RESNET = ["model.name=resnet3d", "model.width=12", "model.depth=10", "model.base_channels=4"]
EXTRA = [  # (label, model, layout, more overrides)
    ("cosmoflow-bn s2xd2 deep", MODELS["cosmoflow-bn"], "s2xd2", DEEP),
    ("cosmoflow-bn s2xf2 deep", MODELS["cosmoflow-bn"], "s2xf2", DEEP),
    ("tiny s2xh2 deep", MODELS["tiny"], "s2xh2", DEEP),
    ("resnet3d-bn s2xd2", RESNET, "s2xd2", []),  # residual blocks, batch norm
    ("resnet3d-bn s2xc2", RESNET, "s2xc2", []),
]
LOCAL_BN = LAYOUTS["s2xd2"] + ["parallel.bn_statistics=local"]


def cases() -> list[tuple]:
    """``(ranks, label, config, batch sizes, evaluation size)`` of every checked run."""
    found = [(ranks_of(layout), f"{model} {name}", make_config(MODELS[model], layout),
              SIZES, EVAL)
             for model in MODELS for name, layout in LAYOUTS.items()]
    found += [(ranks_of(LAYOUTS[name]), label, make_config(model, LAYOUTS[name] + extra),
               SIZES, EVAL) for label, model, name, extra in EXTRA]
    return found


def local_bn_failures(world) -> list[str]:
    """bn_statistics local on s2 x d2, batches of 1: the second sample group never sees a
    sample, so its running statistics stay the initial ones (not 0 / 0, not pulled
    towards 0), and its evaluation predictions are finite."""
    cfg = make_config(MODELS["cosmoflow-bn"], LOCAL_BN)
    grid = ProcessGrid(world, resolve_parallel(cfg, world.Get_size()))
    empty = grid.coord("sample") == 1
    grid.free()
    run = hybrid_short_run(cfg, world, np.float32, (1, 1), EVAL)
    initial = {name: np.asarray(layer.buffers[key]) for name, layer, key
               in build_model(cfg.model, cfg.train.seed).named_buffers()}
    bad = [f"local bn: buffer {name} {'moved' if empty else 'not finite'}"
           for name, value in run["buffers"].items() if "running" in name and
           not (np.array_equal(value, initial[name]) if empty else np.isfinite(value).all())]
    if not np.all(np.isfinite(run["eval"])):
        bad.append(f"local bn: evaluation predictions {run['eval']}")
    return bad


@pytest.mark.parallel(nprocs=[4])
@abort_on_error
def test_empty_sample_groups_match_one_process() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _parallel.set_num_workers(1)
    failures = run_short_waves(world, cases(), np.float32, RTOL)
    failures += local_bn_failures(world)
    failures = everyone_failures(world, failures)
    assert not failures, f"{len(failures)} mismatches: {failures[:20]}"


def test_kernels_accept_no_sample() -> None:
    x = np.zeros((0, 4, 5, 6, 7), np.float32)
    w = np.ones((8, 4, 3, 3, 3), np.float32)
    y = conv3d.conv3d_forward(x, w, 2, ((1, 0), (1, 1), (0, 1)))
    assert y.shape == (0, 8, 2, 3, 3)
    assert conv3d.conv3d_backward_data(y, w, x.shape, 2, ((1, 0), (1, 1), (0, 1))).shape \
        == x.shape
    dw = conv3d.conv3d_backward_filter(x, y, w.shape, 2, ((1, 0), (1, 1), (0, 1)))
    assert dw.shape == w.shape and not dw.any()
    avg = pool3d.avg_pool3d_forward(x, 3, 2, 1)
    assert avg.shape == (0, 4, 3, 3, 4)
    assert pool3d.avg_pool3d_backward(avg, x.shape, 3, 2, 1).shape == x.shape
    top, arg = pool3d.max_pool3d_forward(x, 2, 2, 0)
    assert top.shape == arg.shape == (0, 4, 2, 3, 3)
    assert pool3d.max_pool3d_backward(top, arg, x.shape, 2, 2, 0).shape == x.shape
    mean, var = bn_statistics(bn_local_sums(x))
    assert np.all(mean == 0) and np.all(var == 0)  # no 0 / 0
    with pytest.raises(ValueError, match="dy shape"):
        conv3d.conv3d_backward_filter(x, np.zeros((0, 8, 5, 6, 7), np.float32), w.shape, 2, 1)
    with pytest.raises(ValueError, match="N >= 0"):
        conv3d.conv3d_forward(np.zeros((1, 0, 5, 6, 7), np.float32), w)


# End to end: 8 synthetic samples, 1 held out; batches of 6 leave a last batch of 1.
TRAIN = ["model.name=tiny", "model.width=12", "model.batchnorm=true", "data.source=synthetic",
         "data.synthetic.samples=8", "data.synthetic.val_fraction=0.125",
         "train.batch_size=6", "data.drop_last=false", "train.epochs=1",
         "optimizer.name=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.9"]


def run_cli(*args: str, ranks: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cosmotrain", *args]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    done = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def logged(run: Path) -> list[float]:
    """Training losses and validation MSE, in order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] if row["kind"] == "train" else row["mse"] for row in rows
            if row["kind"] in ("train", "validation")]


def predicted(run: Path, out: Path, ranks: int, layout: list[str]) -> np.ndarray:
    checkpoint = sorted((run / "checkpoints").glob("ckpt_step*.h5"))[-1]
    done = run_cli("predict", "--checkpoint", str(checkpoint), "--data", str(run / "data"),
                   "--out", str(out), "--split", "validation", *sets(layout), ranks=ranks)
    assert "validation: 1 sample(s)" in done.stdout
    with h5py.File(out, "r") as f:
        return f["validation/prediction"][()]


def test_train_and_predict_with_an_empty_sample_group(tmp_path: Path) -> None:
    one, four = tmp_path / "one", tmp_path / "four"
    run_cli("train", *sets([*TRAIN, f"output.dir={one}"]), ranks=1)
    run_cli("train", *sets([*TRAIN, f"output.dir={four}", "parallel.sample=2",
                            "parallel.depth=2"]), ranks=4)
    assert len(logged(one)) == 3  # batches of 6 and 1, then the 1-sample validation
    np.testing.assert_allclose(logged(four), logged(one), rtol=1e-4)
    serial = predicted(one, tmp_path / "one.h5", 1, [])
    split = predicted(one, tmp_path / "four.h5", 4, ["parallel.depth=2"])
    np.testing.assert_allclose(split, serial, rtol=1e-4, atol=1e-6)
