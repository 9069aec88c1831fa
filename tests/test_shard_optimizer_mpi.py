"""``parallel.shard_optimizer``: the optimizer state sharded over each parameter's replicas.

* Equivalence on 4 ranks, N4, N2D2 and C2D2 (the block parameters reduced over the data
  group, the head over every rank), one bucket and many small ones (pieces straddling
  buckets and ranges): SGD with momentum in float32, Adam in float32 and float64, 3
  steps.  The sharded run's parameter changes match one process (1e-4 float32, 1e-7
  float64, as ``tests/test_hybrid_mpi.py``; float32 Adam: the parameter values, 1e-4) and
  the unsharded run's (1e-5 / 1e-12: only the order of the reduction's additions
  differs; float32 SGD's conv1 change measured 1.2e-6 on an AVX-512 host, 2026-11-27,
  whose OpenBLAS kernels round differently from the AVX2 host's that gave < 1e-6), and so
  does its optimizer state, gathered.  Each
  rank holds exactly its ranges' state (1/R of every bucket), and after backward only
  its shard of each reduced gradient, in the same array every step.
* The non-finite guard: a NaN entering one rank's gradient reaches the shard's owner,
  every rank learns it at the next step, no collective is left unmatched, and no
  parameter becomes non-finite; unsharded, every rank sees the NaN and keeps its
  parameters exactly.
* C2 on 2 ranks, where each rank's channel blocks are reduced in no bucket: sharded,
  they take the ordinary update (as unsharded) and a NaN in their gradients is caught.
* Checkpoints through the trainer (C2D2, Adam): a sharded run's checkpoint equals the
  unsharded run's, and resuming across shard settings (sharded -> unsharded, unsharded ->
  sharded, sharded -> sharded) continues the unsharded trajectory.
* Without MPI: the pieces of every rank partition every bucket, a released page buffer
  is usable again, and the planner's memory model counts 1/R of the optimizer state.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import abort_on_error, latest_checkpoint
from equivalence import as_dtype, batch_data, make_config, relative_error, serial_run

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.load import load_config
from cosmotrain.nn.module import Context, Parameter
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.grad_sync import Bucket
from cosmotrain.train.checkpoints.full_state import full_state, optimizer_blocks
from cosmotrain.engine.step import hybrid_step_from_config

TINY = ["model.name=tiny", "model.width=8"]
SGD = ["optimizer.name=sgd", "optimizer.lr=0.002", "optimizer.momentum=0.9"]
ADAM = ["optimizer.name=adam", "optimizer.lr=0.001"]
SMALL_BUCKETS = ["parallel.bucket_mb=0.0005"]  # 131 float32 elements: many buckets
LAYOUTS = {"N4": ["parallel.sample=4"],
           "N2D2": ["parallel.sample=2", "parallel.depth=2", *SMALL_BUCKETS],
           "C2D2": ["parallel.channel=2", "parallel.depth=2", *SMALL_BUCKETS]}
SHARD = ["parallel.shard_optimizer=true"]
STEPS = 3


def train_steps(cfg, comm, dtype) -> dict:
    """``STEPS`` steps on ``comm``; full parameters, optimizer state (on rank 0), and
    the optimizer state elements this rank holds against the parameters it holds."""
    grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    as_dtype(step.model.named_parameters(), dtype)
    initial = step.model.full_parameters()
    x, targets = batch_data(cfg, dtype)
    dist, coord = step.model.input_distribution(x.shape)
    losses, dropped, shards, same = [], True, None, True
    for it in range(STEPS):
        out = step.gradients(DistTensor.scatter(x, dist, coord), targets,
                             Context(step=it, seed=cfg.train.seed))
        if step.reducer.shard:  # only the shard of each reduced gradient is left, ...
            dropped &= all(b.buffer is None and b.shard.size == b.span[1] - b.span[0]
                           for b in step.reducer.buckets)
            # ... in the same array every step (no allocation at a timing-set moment)
            kept = [b.shard for b in step.reducer.buckets]
            same &= shards is None or all(a is b for a, b in zip(kept, shards))
            shards = kept
        losses.append(out.loss)
        step.update()
    blocks = optimizer_blocks(step)
    state = full_state(step, 0, blocks) if grid.group_comms["data"].Get_rank() == 0 else None
    run = {"losses": losses, "initial": initial, "params": step.model.full_parameters(),
           "optimizer": state[2] if comm.Get_rank() == 0 else None,
           "held": held_elements(step), "dropped": dropped, "same_shards": same}
    grid.free()
    return run


def held_elements(step) -> tuple[int, int, bool]:
    """(state elements this rank holds for bucketed parameters, what its ranges of the
    buckets hold, whether each range is at most ceil(bucket / R))."""
    state = step.optimizer.state
    names = {id(p): n for n, p in step.model.named_parameters()}
    buckets = step.reducer.buckets
    held = sum(np.size(v) for b in buckets for p in b.params
               for v in state[names[id(p)]].values() if np.ndim(v))
    slots = len([v for v in next(iter(state.values())).values() if np.ndim(v)])
    if not step.reducer.shard:
        return held, slots * sum(b.size for b in buckets), True
    balanced = all(b.span[1] - b.span[0] <= -(-b.size // b.comm.Get_size())
                   for b in buckets)
    return held, slots * sum(b.span[1] - b.span[0] for b in buckets), balanced


def changes(run: dict, ref: dict, values: bool = False) -> dict[str, float]:
    """Relative error of each parameter's change over the run (of its value: ``values``)."""
    start = {n: 0.0 if values else p for n, p in ref["initial"].items()}
    return {f"param {n}": relative_error(run["params"][n] - start[n], p - start[n])
            for n, p in ref["params"].items()}


def state_differences(got: dict, ref: dict) -> dict[str, float]:
    if sorted(got) != sorted(ref):
        return {"optimizer state names": np.inf}
    out = {}
    for name, slots in ref.items():
        for key, value in slots.items():
            if np.ndim(value):
                out[f"state {name}.{key}"] = relative_error(got[name][key], value)
            elif got[name][key] != value:
                out[f"state {name}.{key}"] = np.inf
    return out


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_sharded_optimizer_trains_like_one_process() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failures = []
    # float32 Adam: parameter values (its changes amplify rounding noise, see the docstring
    # of tests/equivalence.py's adam64_failures); float64 Adam: changes, as the hybrid tests
    for optimizer, dtype, rtol, rtol_unsharded, values in (
            (SGD, np.float32, 1e-4, 1e-5, False), (ADAM, np.float32, 1e-4, 1e-5, True),
            (ADAM, np.float64, 1e-7, 1e-12, False)):
        one = world.bcast(serial_run(make_config(TINY, optimizer=optimizer), dtype)
                          if world.rank == 0 else None)
        for label, layout in LAYOUTS.items():
            what = f"{label} {optimizer[0]} {np.dtype(dtype).name}"
            plain = train_steps(make_config(TINY, layout, optimizer), world, dtype)
            sharded = train_steps(make_config(TINY, layout + SHARD, optimizer), world, dtype)
            held, expected, balanced = sharded["held"]
            if held != expected or not balanced or not held < 0.6 * plain["held"][0]:
                failures.append(f"{what}: rank {world.rank} holds {held} state elements, "
                                f"its ranges {expected}, unsharded {plain['held'][0]}")
            if not sharded["dropped"]:
                failures.append(f"{what}: a full gradient bucket outlived its reduction")
            if not sharded["same_shards"]:
                failures.append(f"{what}: a bucket's shard moved to a new array")
            if world.rank != 0:
                continue
            errors = {f"vs one process {k}": (v, rtol)
                      for k, v in changes(sharded, one, values).items()}
            errors.update({f"vs unsharded {k}": (v, rtol_unsharded) for k, v in
                           {**changes(sharded, {**one, "params": plain["params"]}, values),
                            **state_differences(sharded["optimizer"],
                                                plain["optimizer"])}.items()})
            errors["losses"] = (relative_error(sharded["losses"], one["losses"]), rtol)
            failures += [f"{what}: {k} {v:.1e}" for k, (v, bound) in errors.items()
                         if not v <= bound]
    failures = sorted(set(sum(world.allgather(failures), [])))
    assert not failures, failures


def poisoned_steps(world, shard: list[str], layout: list[str] = LAYOUTS["N4"],
                   unbucketed: bool = False) -> list[tuple]:
    """Two steps of Adam in which rank 1 adds a NaN to the first gradient it reports (of
    a parameter reduced in no bucket: ``unbucketed``); every rank's (agreed bad
    gradients, second step finite, own verdict, parameters finite, parameters unchanged
    since the start)."""
    cfg = make_config(TINY, layout + shard, ADAM)
    grid = ProcessGrid(world, resolve_parallel(cfg, world.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    x, targets = batch_data(cfg, np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    report = step.reducer.on_grad_ready
    initial = [p.data.copy() for _, p in step.model.named_parameters()]
    poisoned = []

    def poison(layer) -> None:  # rank 1 adds a NaN to the first gradient it reports
        param = next(iter(layer.params.values()), None)
        if world.rank == 1 and not poisoned and param is not None and \
                step.reducer.owns(param) != unbucketed:
            grad = param.grad
            grad.reshape(-1)[-1] = np.nan
            poisoned.append(layer)
        report(layer)

    step.reducer.on_grad_ready = poison
    outs = []
    for it in range(2):
        outs.append(step.gradients(DistTensor.scatter(x, dist, coord), targets,
                                   Context(step=it, seed=cfg.train.seed)))
        if outs[-1].finite:
            step.update()
    params = [p.data for _, p in step.model.named_parameters()]
    finite = all(np.isfinite(p).all() for p in params)
    unchanged = all(np.array_equal(a, b) for a, b in zip(params, initial))
    verdicts = world.allgather((outs[1].votes.bad_gradients, outs[1].finite,
                                step.gradients_bad, finite, unchanged))
    grid.free()
    return verdicts


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_a_non_finite_gradient_is_agreed_and_stored_nowhere() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    verdicts = poisoned_steps(world, SHARD)
    assert [v[0] for v in verdicts] == [1] * 4  # one rank owned the NaN, all know
    assert not any(v[1] for v in verdicts)      # the second step is applied nowhere
    assert sum(v[2] for v in verdicts) == 1
    assert all(v[3] for v in verdicts)          # no parameter took the NaN
    # Unsharded: the allreduced gradient carries the NaN to every rank, and every rank
    # keeps its parameters exactly (docs/RELIABILITY.md), not merely finite ones.
    verdicts = poisoned_steps(world, [])
    assert [v[0] for v in verdicts] == [4] * 4
    assert not any(v[1] for v in verdicts)
    assert all(v[3] and v[4] for v in verdicts)


@pytest.mark.parallel(nprocs=2)
@abort_on_error
def test_unbucketed_parameters_are_updated_and_guarded_when_sharded() -> None:
    """C2: each rank holds its own channel block of the convolutions, reduced over no
    other rank (no bucket), beside the head's buckets.  Sharded, those blocks take the
    ordinary update (as unsharded), and a NaN in one of their gradients is caught."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    layout = ["parallel.channel=2"]
    plain = train_steps(make_config(TINY, layout, SGD), world, np.float32)
    sharded = train_steps(make_config(TINY, layout + SHARD, SGD), world, np.float32)
    errors = {k: v for k, v in changes(sharded, plain).items() if not v <= 1e-5}
    verdicts = poisoned_steps(world, SHARD, layout, unbucketed=True)
    assert not errors, errors
    assert [v[0] for v in verdicts] == [1, 1]     # rank 1's own NaN, agreed by both
    assert not any(v[1] for v in verdicts) and all(v[3] for v in verdicts)


CKPT = ["data.source=synthetic", "data.synthetic.samples=18",
        "data.synthetic.val_fraction=0.12", "model.width=8", "train.batch_size=4",
        "train.epochs=4", "train.validate_every=0", "train.checkpoint_every_epochs=0",
        "parallel.sample=1", "parallel.channel=2", "parallel.depth=2", *SMALL_BUCKETS]
REPO_TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def run_to(out: Path, steps: int, shard: bool, resume: bool = False):
    """Train (or resume) to ``steps`` steps; the checkpoint written at the end."""
    from mpi4py import MPI

    from cosmotrain.train import run as runner
    from cosmotrain.train.checkpoints.checkpoint import (checkpoint_dir, load_checkpoint)

    cfg = load_config(REPO_TINY, [*CKPT, f"output.dir={out}", f"train.max_steps={steps}",
                                  f"parallel.shard_optimizer={str(shard).lower()}"])
    runner.run_training(cfg, MPI.COMM_WORLD, resume=resume)
    MPI.COMM_WORLD.Barrier()
    return load_checkpoint(latest_checkpoint(checkpoint_dir(out)))


def copy(source: Path, target: Path) -> None:
    """A second copy of a stopped run, to resume it a second way."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 0:
        shutil.copytree(source, target)
    MPI.COMM_WORLD.Barrier()


def checkpoint_differences(got, ref) -> dict[str, float]:
    out = {"step": 0.0 if got.step == ref.step else np.inf}
    for part in ("params", "buffers"):
        mine, theirs = getattr(got, part), getattr(ref, part)
        if sorted(mine) != sorted(theirs):
            out[part] = np.inf
            continue
        out.update({f"{part} {n}": relative_error(mine[n], v) if
                    np.shape(mine[n]) == np.shape(v) and np.asarray(mine[n]).dtype ==
                    np.asarray(v).dtype else np.inf for n, v in theirs.items()})
    out.update(state_differences(got.optimizer, ref.optimizer))
    return out


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_checkpoints_do_not_depend_on_sharding_and_resume_across_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi4py import MPI

    from cosmotrain.train import run as runner
    from cosmotrain.train.outputs.observers import Observers

    world = MPI.COMM_WORLD
    monkeypatch.setattr(runner, "make_observers", lambda *args: Observers([]))
    root = Path(world.bcast(tempfile.mkdtemp() if world.rank == 0 else None))
    try:
        plain_2 = run_to(root / "u", 2, shard=False)
        copy(root / "u", root / "u2")
        plain_4 = run_to(root / "u", 4, shard=False, resume=True)
        sharded_2 = run_to(root / "s", 2, shard=True)
        copy(root / "s", root / "s2")
        resumed = {"sharded -> unsharded": run_to(root / "s", 4, shard=False, resume=True),
                   "sharded -> sharded": run_to(root / "s2", 4, shard=True, resume=True),
                   "unsharded -> sharded": run_to(root / "u2", 4, shard=True, resume=True)}
    finally:
        world.Barrier()
        if world.rank == 0:
            shutil.rmtree(root)
    assert plain_4.step == 4 and plain_4.optimizer  # Adam state after 4 steps
    failures = {f"step 2 checkpoint {k}": v for k, v in
                checkpoint_differences(sharded_2, plain_2).items() if not v <= 1e-6}
    for how, got in resumed.items():
        failures.update({f"{how} {k}": v for k, v in
                         checkpoint_differences(got, plain_4).items() if not v <= 1e-5})
    assert not failures, failures


class FakeComm:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size


@pytest.mark.parametrize("sizes, ranks", [([5, 1, 7, 3], 4), ([2], 4), ([3, 3], 3),
                                          ([10], 1), ([1, 1, 1, 1, 1, 9], 6)])
def test_the_pieces_of_every_rank_partition_the_bucket(sizes: list[int], ranks: int) -> None:
    from cosmotrain.tensor.distribution import block_range

    params = [Parameter(np.zeros(n, np.float32)) for n in sizes]
    counts = [hi - lo for lo, hi in (block_range(sum(sizes), ranks, r) for r in range(ranks))]
    seen = [np.zeros(n, int) for n in sizes]
    for rank in range(ranks):
        bucket = Bucket(FakeComm(rank, ranks), params, sum(sizes), np.float32, np, counts)
        a, b = bucket.span
        covered = 0
        for i, piece in enumerate(bucket.pieces()):
            assert piece.param is params[i]
            seen[i][piece.lo:piece.hi] += 1
            flat = sum(sizes[:i]) + piece.lo  # the piece's place in the bucket
            assert piece.hi == piece.lo or (a <= flat and flat + piece.hi - piece.lo <= b
                                            and piece.at == flat - a)
            covered += piece.hi - piece.lo
        assert covered == b - a == counts[rank]
    assert all((s == 1).all() for s in seen)  # every element in exactly one rank's range


def test_a_page_buffer_hands_its_pages_back_and_stays_usable() -> None:
    from cosmotrain.device.pages import PageBuffer

    buffer = PageBuffer(100_000, np.float32)
    buffer.array[:] = 3.0
    buffer.release()
    if sys.platform.startswith("linux"):  # dropped pages of a private map read as zeros
        assert not buffer.array.any()
    buffer.array.fill(0)
    buffer.array[7] = 2.0
    assert buffer.array.sum() == 2.0 and buffer.array.dtype == np.float32


def test_a_page_buffer_gives_zeros_without_touching_pages_it_handed_back() -> None:
    """A gradient bucket's pages become resident only when its gradients land."""
    from cosmotrain.device.pages import PageBuffer

    buffer = PageBuffer(1 << 22, np.float32)  # 16 MiB
    assert not buffer.zeros().any()
    buffer.written()[:] = 5.0
    assert not buffer.zeros().any()  # still written: filled
    buffer.zeros()[:] = 1.0
    buffer.release()
    if not sys.platform.startswith("linux"):
        return
    before = _resident_mib()
    zeros = buffer.zeros()
    assert _resident_mib() - before < 2  # not written: no page faulted in
    assert not zeros.any()


def _resident_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_the_memory_model_counts_one_rth_of_the_optimizer_state() -> None:
    from cosmotrain.config.layout import Layout
    from cosmotrain.plan.memory import rank_memory
    from cosmotrain.plan.workload import build_workload

    base = ["model.width=32", "train.batch_size=4", "optimizer.name=adam"]
    layout = Layout(1, depth=2, height=2)
    plain = build_workload(load_config(None, base), layout)
    sharded = build_workload(load_config(None, base + SHARD), layout)
    params = plain.params_held
    assert plain.state_held == params and sharded.state_held == -(-params // 4)
    saved = rank_memory(plain).state - rank_memory(sharded).state
    assert saved == 4 * 2 * (params - sharded.state_held)  # two Adam slots, float32
