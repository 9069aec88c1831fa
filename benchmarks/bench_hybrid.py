"""Hybrid sample x spatial training steps under MPI: time breakdown, memory, final state.

    [mpiexec -n P] python benchmarks/bench_hybrid.py [--config FILE] [--set KEY=VALUE ...]
        [--steps N] [--warmup W] [--memory] [--threads T] [--save FILE.npz]
        [--compare FILE.npz]

Every rank builds only its own input block (a deterministic function of the global voxel
index, so every rank layout trains on the same mini-batch) and runs ``--steps`` training
steps of the configured model and strategy.  Rank 0 prints, as one JSON object:

* seconds per step (slowest rank, best step after ``--warmup``) and the mean per-rank
  breakdown: halo, allreduce, redistribution, channel (time spent waiting on or
  packing messages, see ``runtime/timers.py``) and compute (the rest);
* with ``--memory``: per-rank bytes held before a step (parameters, optimizer state,
  input block) and the peak working memory of a step above that (tracemalloc; the run
  is slower, so time and memory are separate runs);
* the loss of every step.

``--save`` writes the final parameters (rank 0); ``--compare`` reports the largest
relative difference against a saved run, e.g. 4 ranks (D2H2) against 1 rank.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from typing import Any, Sequence

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np
from mpi4py import MPI

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.threads import job_threads
from cosmotrain.runtime.timers import PHASES
from cosmotrain.config.load import load_config
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.kernels.cpu.workers import KernelThreads
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.step import HybridStep, hybrid_step_from_config, job_runtime


def input_block(dist: Any, coord: tuple[int, ...]) -> DistTensor:
    """This rank's block of a smooth, deterministic mini-batch (no full array anywhere)."""
    return DistTensor(smooth_block(dist.block(coord)), dist, coord)


def smooth_block(box: Sequence[slice]) -> np.ndarray:
    """The mini-batch on the index box ``box`` (N, C, D, H, W slices of the global batch):
    a smooth function of the global voxel index, so that any rank can build any part of
    the same batch (``bench_ddp.py``'s PyTorch side builds its own parts with it)."""
    axes = np.ix_(*[np.arange(s.start, s.stop, dtype=np.float32) for s in box])
    n, c, d, h, w = axes
    block = np.sin(0.37 * d + 0.11 * h * (c + 1) + 0.23 * w + 1.3 * n)
    block = block * np.cos(0.05 * (d - h) * w / 7.0 + c) + 0.1 * c
    return block.astype(np.float32)


def targets(batch: int, outputs: int) -> np.ndarray:
    return np.random.default_rng(11).uniform(-1, 1, size=(batch, outputs)).astype(np.float32)


def run_steps(step: HybridStep, x: DistTensor, y: np.ndarray, steps: int,
              memory: bool) -> list[dict]:
    records = []
    for index in range(steps):
        if memory:
            tracemalloc.reset_peak()
            held = tracemalloc.get_traced_memory()[0]
        step.runtime.timers.take()
        step.grid.cart.Barrier()
        start = time.perf_counter()
        out = step(DistTensor(x.data.copy(), x.dist, x.coord), y, Context(step=index))
        seconds = time.perf_counter() - start
        record = {"seconds": seconds, "loss": out.loss, **step.runtime.timers.take()}
        if memory:
            peak = tracemalloc.get_traced_memory()[1]
            record.update(held=held, peak_work=peak - held)
        records.append(record)
    return records


def summarise(comm: Any, records: list[dict], warmup: int, memory: bool) -> dict:
    timed = records[warmup:] or records
    best = min(range(len(timed)), key=lambda i: timed[i]["seconds"])
    mine = timed[best]
    comm_s = {k: mine[k] for k in PHASES}
    mine_breakdown = {**comm_s, "compute": mine["seconds"] - sum(comm_s.values())}
    breakdowns = comm.gather(mine_breakdown, root=0)
    slowest = comm.allreduce(mine["seconds"], op=MPI.MAX)
    result: dict = {"seconds_per_step": slowest, "losses": [r["loss"] for r in records]}
    if breakdowns is not None:
        result["breakdown_mean"] = {k: float(np.mean([b[k] for b in breakdowns]))
                                    for k in mine_breakdown}
    if memory:
        held = comm.gather(max(r["held"] for r in records), root=0)
        work = comm.gather(max(r["peak_work"] for r in records[1:] or records), root=0)
        if held is not None:
            result["memory_mib"] = {"held_max": max(held) / 2**20,
                                    "step_peak_max": max(work) / 2**20,
                                    "step_peak_per_rank": [w / 2**20 for w in work]}
    return result


def compare(full: dict, path: str) -> float:
    saved = np.load(path)
    return max(float(np.linalg.norm(p - saved[n]) / max(np.linalg.norm(saved[n]), 1e-30))
               for n, p in full.items())


def setup(world: Any, args: argparse.Namespace) -> tuple[Any, HybridStep, DistTensor]:
    """BLAS threads (``--threads``), the config (``--config``, ``--set``), the model step
    on the grid it asks for, and this rank's input block."""
    threads = job_threads(world) if args.threads is None else KernelThreads(args.threads)
    cfg = load_config(args.config, args.overrides)
    step, x = build_step(world, cfg, threads)
    return cfg, step, x


def build_step(world: Any, cfg: Any, threads: KernelThreads | None = None
               ) -> tuple[HybridStep, DistTensor]:
    """The trainer's step for ``cfg`` on the grid and device it asks for, and this rank's
    input block.  With ``threads`` the step's runtime is a job's, as ``cosmotrain train``
    builds it: the threads applied and the host heap following
    ``device.reuse_freed_memory``; None leaves both to the caller (``bench_ddp.py``)."""
    grid = ProcessGrid(world, resolve_parallel(cfg, world.Get_size()))
    step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, threads=threads))
    width = cfg.model.width
    dist, coord = step.model.input_distribution((cfg.train.batch_size, cfg.model.channels,
                                                 width, width, width))
    return step, input_block(dist, coord)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--threads", type=int, default=None,
                        help="BLAS threads per rank (default: the node's cores / its ranks)")
    parser.add_argument("--save")
    parser.add_argument("--compare")
    args = parser.parse_args()

    if args.memory:
        tracemalloc.start()  # before the model: parameters count as held
    world = MPI.COMM_WORLD
    cfg, step, x = setup(world, args)
    grid, width, batch = step.grid, cfg.model.width, cfg.train.batch_size
    records = run_steps(step, x, targets(batch, cfg.model.outputs), args.steps, args.memory)
    result = summarise(world, records, args.warmup, args.memory)
    result.update(param_mib=sum(p.data.nbytes for _, p in step.model.named_parameters())
                  / 2**20, ranks=world.Get_size(), strategy=grid.layout.describe(),
                  spatial_stop=step.model.stop, width=width, batch=batch)
    full = step.model.full_parameters()  # collective: channel-split blocks gathered
    if args.compare:
        result["max_rel_param_diff_vs_saved"] = compare(full, args.compare)
    if world.rank == 0:
        if args.save:
            np.savez(args.save, **full)
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
