"""The equivalence harness of the parallel training tests: one process vs a grid.

A *case* is ``(ranks, label, config, reference key)``.  The single-process reference of
each config is computed once, on rank 0, and broadcast; the cases run in waves on
disjoint sub-communicators of the world (four 2-rank cases at once, and so on), so no
rank idles.  Every compared quantity is gathered to full arrays first, so sharded
parameters (channel/filter parallelism) compare like replicated ones.

Tolerance: each tensor's error norm <= ``rtol`` times its norm, the losses likewise.
The parameter check is on the *change* of each parameter over the steps (the initial
values cancel).  Where float32 itself is less accurate than ``rtol`` on one process, the
bound is twice the one-process float32-vs-float64 error.
"""

from __future__ import annotations

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.load import load_config
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.layers.loss import loss_and_sums
from cosmotrain.layers.shards import gather_full
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.optim import build_optimizer
from cosmotrain.engine.step import hybrid_step_from_config

STEPS = 3
BATCH = 4
SGD = ["optimizer.name=sgd", "optimizer.lr=0.002", "optimizer.momentum=0.9"]



def batch_loss(pred, target, global_count: int) -> tuple[float, object]:
    """``(loss over the batch, d loss / d pred)`` of one process: the engine's own loss."""
    loss, grad, _ = loss_and_sums(pred, target, global_count)
    return loss, grad

def ranks_of(overrides: list[str]) -> int:
    """Ranks a strategy needs: the product of its ``parallel.*=N`` overrides."""
    return int(np.prod([int(o.split("=")[1]) for o in overrides if o.startswith("parallel.")
                        and o.split("=")[1].isdigit()]))


def make_config(model: list[str], extra: list[str] = (), optimizer: list[str] = SGD):
    return load_config(None, [*model, f"train.batch_size={BATCH}", *optimizer, *extra])


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


def full_gradients(model) -> dict:
    """Every parameter gradient as the full array (blocks gathered)."""
    items = [(n, p.grad, p.shard) for n, p in model.named_parameters()]
    return gather_full(model.grid.group_comms["channel_filter"], items)


def hybrid_run(cfg, comm, dtype, inspect=None) -> dict:
    """The same trajectory on ``comm``; predictions, gradients and state gathered."""
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
            run["grads"] = full_gradients(step.model)
        run["losses"].append(out.loss)
        step.update()
    run["params"] = step.model.full_parameters()
    run["buffers"] = step.model.full_buffers()
    run["stop"] = step.model.stop
    if inspect is not None:
        run["inspect"] = inspect(step)
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


def errors(got: dict, ref: dict) -> dict[str, float]:
    """Relative error of every checked quantity of ``got`` against ``ref``."""
    found = {"pred": relative_error(got["pred"], ref["pred"])}
    found.update({f"loss{i}": abs(a - b) / abs(b)
                  for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))})
    found.update({f"grad {n}": relative_error(got["grads"][n], g)
                  for n, g in ref["grads"].items()})
    return {**found, **state_errors(got, ref)}


def state_errors(got: dict, ref: dict) -> dict[str, float]:
    """Relative error of the parameter changes and of the buffers after the run."""
    found = {f"param {n}": relative_error(got["params"][n] - ref["initial"][n],
                                          p - ref["initial"][n])
             for n, p in ref["params"].items()}
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


def join_case(world, wave: list[tuple]) -> tuple:
    """This rank's case of ``wave`` (cases take consecutive ranks, ``case[0]`` of them;
    None when the wave leaves it idle) and the communicator of the ranks sharing it."""
    start, mine = 0, None
    for case in wave:
        if start <= world.rank < start + case[0]:
            mine = case
        start += case[0]
    return mine, world.Split(0 if mine is None else 1 + wave.index(mine), world.rank)


def run_waves(world, cases: list[tuple], refs: dict, dtype, rtol, inspect=None,
              check=None) -> list[str]:
    """Run every case (ranks, label, cfg, ref key) on its slice of ``world``.

    ``inspect(step)`` may record more of a run (``run["inspect"]``, on every rank) and
    ``check(case, run)`` turn it into extra failure strings.
    """
    failures = []
    for wave in waves(cases, world.Get_size()):
        mine, comm = join_case(world, wave)
        if mine is not None:
            got = hybrid_run(mine[2], comm, dtype, inspect)
            failures += [f"{mine[1]}: {what}" for what in compare(refs[mine[3]], got, rtol)]
            if check is not None:
                failures += [f"{mine[1]}: {what}" for what in check(mine, got)]
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


def adam64_failures(world, models: dict, strategies: dict, pairs: list[tuple[str, str]],
                    inspect=None, check=None) -> list[str]:
    """Adam in float64 (1e-7) for ``(model, strategy)`` pairs: float32 Adam turns rounding
    noise into full steps of arbitrary sign, on one rank as on many."""
    refs = {(m, "adam"): make_config(models[m], optimizer=[]) for m, _ in pairs}
    cases = [(ranks_of(strategies[s]), f"{m} {s} adam float64",
              make_config(models[m], strategies[s], optimizer=[]), (m, "adam"))
             for m, s in pairs]
    return run_waves(world, cases, broadcast_refs(world, refs, np.float64), np.float64,
                     1e-7, inspect, check)


def everyone_failures(world, failures: list[str]) -> list[str]:
    """Every rank's failures on every rank, so all reach the same verdict."""
    return sorted(set(sum(world.allgather(failures), [])))


# Short batches: fewer samples than sample groups -------------------------------------
#
# The model is planned for ``train.batch_size`` (as the trainer does) and then fed
# batches of ``sizes[i]`` samples (a last partial batch, a small validation split), so
# some sample groups hold none.  Every step's predictions, loss and gradients are
# compared (not only the first), then an evaluation forward of ``eval_size`` samples
# (running statistics, no dropout: the validation and ``predict`` path).


def short_batches(cfg, dtype, sizes) -> list[tuple]:
    """``(x, targets)`` of ``n`` samples for each ``n`` of ``sizes`` (fixed seed)."""
    rng = np.random.default_rng(11)
    width, channels = cfg.model.width, cfg.model.channels
    return [(rng.normal(size=(n, channels, width, width, width)).astype(dtype),
             rng.normal(size=(n, cfg.model.outputs)).astype(dtype)) for n in sizes]


def serial_short_run(cfg, dtype, sizes, eval_size: int) -> dict:
    """The one-process trajectory over batches of ``sizes``, then an evaluation forward."""
    model = build_model(cfg.model, cfg.train.seed)
    as_dtype(model.named_parameters(), dtype)
    optimizer = build_optimizer(cfg.optimizer)
    run = {"initial": {n: p.data.copy() for n, p in model.named_parameters()}, "steps": []}
    for it, (x, targets) in enumerate(short_batches(cfg, dtype, sizes)):
        ctx = Context(step=it, seed=cfg.train.seed)
        pred = model.forward(x, ctx)
        loss, dpred = batch_loss(pred, targets, targets.size)
        model.backward(dpred, ctx)
        params = list(model.named_parameters())
        run["steps"].append(dict(pred=pred, loss=loss,
                                 grads={n: p.grad.copy() for n, p in params}))
        optimizer.step(params)
        optimizer.zero_grad(params)
    (x, _), = short_batches(cfg, dtype, [eval_size])
    run["eval"] = model.forward(x, Context(training=False, seed=0))
    run["params"] = {n: p.data.copy() for n, p in model.named_parameters()}
    run["buffers"] = {n: np.asarray(layer.buffers[k]).copy()
                      for n, layer, k in model.named_buffers()}
    return run


def hybrid_short_run(cfg, comm, dtype, sizes, eval_size: int) -> dict:
    """The same on ``comm``, through the trainer's step; everything gathered in full."""
    grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    as_dtype(step.model.named_parameters(), dtype)
    run = {"steps": []}
    for it, (x, targets) in enumerate(short_batches(cfg, dtype, sizes)):
        dist, coord = step.model.input_distribution(x.shape)
        out = step.gradients(DistTensor.scatter(x, dist, coord), targets,
                             Context(step=it, seed=cfg.train.seed))
        run["steps"].append(dict(pred=gather_rows(comm, out.rows, out.pred, targets.shape),
                                 loss=out.loss, grads=full_gradients(step.model)))
        step.update()
    (x, _), = short_batches(cfg, dtype, [eval_size])
    dist, coord = step.model.input_distribution(x.shape)
    pred = step.model.forward(DistTensor.scatter(x, dist, coord),
                              Context(training=False, seed=0))
    run["eval"] = gather_rows(comm, step.model.sample_range(), pred,
                              (eval_size, cfg.model.outputs))
    run["params"] = step.model.full_parameters()
    run["buffers"] = step.model.full_buffers()
    grid.free()
    return run


def short_errors(got: dict, ref: dict) -> dict[str, float]:
    """Relative error of every step's output, loss and gradients, the evaluation
    output, the parameter changes and the buffers of ``got`` against ``ref``."""
    found = {"eval": relative_error(got["eval"], ref["eval"])}
    for i, (mine, theirs) in enumerate(zip(got["steps"], ref["steps"])):
        found[f"pred{i}"] = relative_error(mine["pred"], theirs["pred"])
        found[f"loss{i}"] = abs(mine["loss"] - theirs["loss"]) / abs(theirs["loss"])
        found.update({f"grad{i} {n}": relative_error(mine["grads"][n], g)
                      for n, g in theirs["grads"].items()})
    return {**found, **state_errors(got, ref)}


def short_reference(cfg, dtype, sizes, eval_size: int) -> dict:
    """:func:`serial_short_run`, with (in float32) its own error against float64."""
    run = serial_short_run(cfg, dtype, sizes, eval_size)
    if dtype == np.float32:
        run["own_error"] = short_errors(run, serial_short_run(cfg, np.float64, sizes,
                                                              eval_size))
    return run


def run_short_waves(world, cases: list[tuple], dtype, rtol: float) -> list[str]:
    """Run every case ``(ranks, label, cfg, sizes, eval_size)`` against its one-process
    reference (computed on rank 0 once per distinct config and sizes, and broadcast)."""
    keys = {_short_key(case): case for case in cases}
    refs = {key: short_reference(c[2], dtype, c[3], c[4]) for key, c in keys.items()} \
        if world.rank == 0 else None
    refs = world.bcast(refs, root=0)
    failures = []
    for wave in waves(cases, world.Get_size()):
        mine, comm = join_case(world, wave)
        if mine is not None:
            got = hybrid_short_run(mine[2], comm, dtype, mine[3], mine[4])
            ref = refs[_short_key(mine)]
            bounds = {k: max(rtol, 2 * e) for k, e in ref.get("own_error", {}).items()}
            failures += [f"{mine[1]}: {key} ({err:.1e})"
                         for key, err in short_errors(got, ref).items()
                         if not err <= bounds.get(key, rtol)]
        comm.Free()
    return failures


def _short_key(case: tuple) -> tuple:
    """What a reference depends on: the model (not the layout), the batch sizes."""
    return (repr(case[2].model), repr(case[2].optimizer), case[2].train.seed,
            tuple(case[3]), case[4])
