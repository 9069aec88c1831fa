"""The invariant, end to end: hybrid sample x spatial training equals one process.

One 8-rank launch.  For tiny, cosmoflow (small W) and resnet3d, batch norm on and off,
uneven blocks included, and every strategy of the issue (N2, D2, H2, W2, D2H2, D2H2W2,
N2D2, N2H2W2), the distributed run must reproduce the single-process run in float32:

* the predictions and loss of the first step, every parameter gradient (after the
  bucketed allreduce) and the batch-norm running statistics;
* the parameters after 3 optimizer steps.

Tolerance (float32): each tensor's error norm <= ``RTOL`` times its norm (``1e-4``), and
the same for the losses.  The parameter check is on the *change* of each parameter over the 3
steps, which is the strict form (the initial values cancel).  Where float32 itself is
less accurate than that, the bound is twice the error of the one-process float32 run
against the one-process float64 run: batch-norm scales of cosmoflow's 1-voxel layers
change by 3e-4 to 6e-4 (relative) differently in float32 and float64 on one process.  It uses SGD with momentum,
whose update is linear in the gradient.  Adam divides each element by its own gradient
history: elements whose gradient is rounding noise move by a full learning rate with an
arbitrary sign, at every rank count alike.  Adam is checked in float64, where the noise
is far below the tolerance.

The single-process reference of each model is computed once, on rank 0, and broadcast.
Cases run in waves on disjoint sub-communicators (four 2-rank cases at once, and so
on), so no rank idles.  Verdicts are allreduced: a failure on one rank fails every rank.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort_on_error

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.load import load_config
from cosmotrain.config.parallel import resolve_parallel
from cosmotrain.kernels import _parallel
from cosmotrain.layers.loss import batch_loss
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.train.optim import build_optimizer
from cosmotrain.train.step import hybrid_step_from_config

RTOL = 1e-4
STEPS = 3
BATCH = 4
SGD = ["optimizer.name=sgd", "optimizer.lr=0.002", "optimizer.momentum=0.9"]
MODELS = {  # uneven blocks: 13 and 18 do not halve evenly all the way down
    "tiny": ["model.name=tiny", "model.width=13", "model.dropout=0.3"],
    "tiny-bn": ["model.name=tiny", "model.width=13", "model.batchnorm=true"],
    "cosmoflow": ["model.name=cosmoflow", "model.width=18"],
    "cosmoflow-bn": ["model.name=cosmoflow", "model.width=18", "model.batchnorm=true"],
    "resnet3d": ["model.name=resnet3d", "model.width=12", "model.depth=10",
                 "model.base_channels=4", "model.batchnorm=false"],
    "resnet3d-bn": ["model.name=resnet3d", "model.width=12", "model.depth=10",
                    "model.base_channels=4"],
}
STRATEGIES = {
    "N2": ["parallel.sample=2"], "D2": ["parallel.depth=2"], "H2": ["parallel.height=2"],
    "W2": ["parallel.width=2"], "D2H2": ["parallel.depth=2", "parallel.height=2"],
    "N2D2": ["parallel.sample=2", "parallel.depth=2"],
    "D2H2W2": ["parallel.depth=2", "parallel.height=2", "parallel.width=2"],
    "N2H2W2": ["parallel.sample=2", "parallel.height=2", "parallel.width=2"],
}
EXTRA = [  # (model, strategy, extra overrides): spatial layers on empty blocks, Adam
    ("cosmoflow-bn", "D2H2W2", ["parallel.spatial_until=flatten"]),
    ("tiny-bn", "N2D2", ["parallel.spatial_until=flatten", "train.seed=3"]),
]
ADAM64 = [("resnet3d-bn", "N2D2"), ("cosmoflow", "D2H2")]


def _ranks(overrides: list[str]) -> int:
    return int(np.prod([int(o.split("=")[1]) for o in overrides]))


def make_config(model: str, extra: list[str] = (), optimizer: list[str] = SGD):
    return load_config(None, [*MODELS[model], f"train.batch_size={BATCH}", *optimizer,
                              *extra])


def batch_data(cfg, dtype):
    rng = np.random.default_rng(7)
    width = cfg.model.width
    x = rng.normal(size=(BATCH, cfg.model.channels, width, width, width)).astype(dtype)
    return x, rng.normal(size=(BATCH, cfg.model.outputs)).astype(dtype)


def as_dtype(params, dtype) -> None:
    for _, param in params:
        param.data = param.data.astype(dtype)


def serial_run(cfg, dtype) -> dict:
    """The single-process trajectory: first-step outputs and gradients, final state."""
    model = build_model(cfg.model, cfg.train.seed)
    as_dtype(model.named_parameters(), dtype)
    optimizer = build_optimizer(cfg.optimizer)
    x, targets = batch_data(cfg, dtype)
    run = {"initial": {n: p.data.copy() for n, p in model.named_parameters()}, "losses": []}
    for step in range(STEPS):
        ctx = Context(step=step, seed=cfg.train.seed)
        pred = model.forward(x.copy(), ctx)
        loss, dpred = batch_loss(pred, targets, targets.size)
        model.backward(dpred, ctx)
        params = list(model.named_parameters())
        if step == 0:
            run.update(pred=pred, grads={n: p.grad.copy() for n, p in params})
        run["losses"].append(loss)
        optimizer.step(params)
        optimizer.zero_grad(params)
    run["params"] = {n: p.data.copy() for n, p in model.named_parameters()}
    run["buffers"] = {n: np.asarray(layer.buffers[k]).copy()
                      for n, layer, k in model.named_buffers()}
    return run


def hybrid_run(cfg, comm, dtype) -> dict:
    """The same trajectory on ``comm``; predictions gathered, gradients reduced."""
    grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    as_dtype(step.model.named_parameters(), dtype)
    x, targets = batch_data(cfg, dtype)
    dist, coord = step.model.input_distribution(x.shape)
    run = {"losses": []}
    for it in range(STEPS):
        ctx = Context(step=it, seed=cfg.train.seed)
        out = step.gradients(DistTensor.scatter(x, dist, coord), targets, ctx)
        if it == 0:
            run["pred"] = gather_rows(comm, out.rows, out.pred, targets.shape)
            run["grads"] = {n: p.grad.copy() for n, p in step.model.named_parameters()}
        run["losses"].append(out.loss)
        step.update()
    run["params"] = {n: p.data.copy() for n, p in step.model.named_parameters()}
    run["buffers"] = {n: np.asarray(layer.buffers[k]).copy()
                      for n, layer, k in step.model.named_buffers()}
    run["stop"] = step.model.stop
    grid.free()
    return run


def gather_rows(comm, rows, pred, shape):
    """The full prediction matrix from every rank's rows."""
    full = np.full(shape, np.nan)
    for (start, stop), block in comm.allgather((rows, pred)):
        full[start:stop] = block
    return full


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return np.inf
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def close(a, b, rtol) -> bool:
    return relative_error(a, b) <= rtol


def errors(got: dict, ref: dict) -> dict[str, float]:
    """Relative error of every checked quantity of ``got`` against ``ref``."""
    found = {"pred": relative_error(got["pred"], ref["pred"])}
    found.update({f"loss{i}": abs(a - b) / abs(b)
                  for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))})
    found.update({f"grad {n}": relative_error(got["grads"][n], g)
                  for n, g in ref["grads"].items()})
    found.update({f"param {n}": relative_error(got["params"][n] - ref["initial"][n],
                                               p - ref["initial"][n])
                  for n, p in ref["params"].items()})
    found.update({f"buffer {n}": relative_error(got["buffers"][n], b)
                  for n, b in ref["buffers"].items()})
    return found


def compare(ref: dict, got: dict, rtol: float) -> list[str]:
    """The quantities that disagree by more than ``rtol`` and the reference's own error."""
    bounds = {key: max(rtol, 2 * err) for key, err in ref.get("own_error", {}).items()}
    return [f"{key} ({err:.1e})" for key, err in errors(got, ref).items()
            if not err <= bounds.get(key, rtol)]


def waves(cases: list[tuple], world_size: int) -> list[list[tuple]]:
    """Pack cases (by rank count) into waves that fit the world, biggest first."""
    out: list[list[tuple]] = []
    for case in sorted(cases, key=lambda c: -c[0]):
        for wave in out:
            if sum(c[0] for c in wave) + case[0] <= world_size:
                wave.append(case)
                break
        else:
            out.append([case])
    return out


def run_waves(world, cases: list[tuple], refs: dict, dtype, rtol) -> list[str]:
    """Run every case (ranks, label, cfg, ref key) on its slice of ``world``."""
    failures = []
    for wave in waves(cases, world.Get_size()):
        start, mine = 0, None
        for case in wave:
            if start <= world.rank < start + case[0]:
                mine = case
            start += case[0]
        comm = world.Split(0 if mine is None else 1 + wave.index(mine), world.rank)
        if mine is not None:
            got = hybrid_run(mine[2], comm, dtype)
            failures += [f"{mine[1]}: {what}" for what in compare(refs[mine[3]], got, rtol)]
        comm.Free()
    return failures


def reference(cfg, dtype) -> dict:
    """The one-process run, with (in float32) its own error against float64."""
    run = serial_run(cfg, dtype)
    if dtype == np.float32:
        run["own_error"] = errors(run, serial_run(cfg, np.float64))
    return run


def broadcast_refs(world, configs: dict, dtype) -> dict:
    refs = {key: reference(cfg, dtype) for key, cfg in configs.items()} \
        if world.rank == 0 else None
    return world.bcast(refs, root=0)


@pytest.mark.parallel(nprocs=8)
@abort_on_error
def test_hybrid_training_matches_one_process() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _parallel.set_num_workers(1)
    configs = {m: make_config(m) for m in MODELS}
    configs.update({(m, tuple(e)): make_config(m, e) for m, _, e in EXTRA})
    cases = []
    for model in MODELS:
        for name, over in STRATEGIES.items():
            cfg = make_config(model, over)
            cases.append((_ranks(over), f"{model} {name}", cfg, model))
    for model, name, extra in EXTRA:
        cases.append((_ranks(STRATEGIES[name]), f"{model} {name} {extra}",
                      make_config(model, STRATEGIES[name] + extra), (model, tuple(extra))))
    failures = run_waves(world, cases, broadcast_refs(world, configs, np.float32),
                         np.float32, RTOL)
    adam = {(m, "adam"): make_config(m, optimizer=[]) for m, _ in ADAM64}
    cases = [(_ranks(STRATEGIES[s]), f"{m} {s} adam float64",
              make_config(m, STRATEGIES[s], optimizer=[]), (m, "adam")) for m, s in ADAM64]
    failures += run_waves(world, cases, broadcast_refs(world, adam, np.float64),
                          np.float64, 1e-7)
    failures = sorted(set(sum(world.allgather(failures), [])))
    assert not failures, f"{len(failures)} mismatches: {failures[:20]}"
