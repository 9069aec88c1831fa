"""Multi-rank training steps: cosmotrain against PyTorch on the same ranks, in the same run.

    mpiexec -n P python benchmarks/bench_ddp.py --model cosmoflow|cosmoflow-mlperf
        --width 128 --batch B --strategy N|D [--steps 5] [--warmup 1] [--interleave]
        [--reuse-freed-memory] [--set KEY=VALUE ...] [--check]

Every rank runs both sides with one thread (cosmotrain's BLAS and kernel workers,
``torch.set_num_threads(1)``), on the same weights (the ``torch.nn`` twin of the model
``train.seed`` builds) and the same global mini-batch (``bench_hybrid.smooth_block``, a
function of the global voxel index: each side builds its own parts), with Adam and the
MSE loss:

* ``--strategy N``: samples over the P ranks (cosmotrain ``parallel.sample=P``; PyTorch
  ``DistributedDataParallel`` over gloo, each rank B/P samples);
* ``--strategy D``: depth over the P ranks (cosmotrain ``parallel.depth=P``, the trainer's
  step; PyTorch the hand-written depth-split peer of ``torch_depth_split.py``, which
  splits the layers before cosmotrain's spatial stop and runs the rest replicated).

Each timed step starts on a barrier; a side's step time is the slowest rank's, and the
figure is the median over ``--steps`` after ``--warmup``.  By default all cosmotrain
steps run, then all PyTorch steps; ``--interleave`` alternates them (on a shared machine
both then meet the same load).  Rank 0 prints a markdown row and the first step's loss of
each side (equal weights and data: they agree to float32 rounding).
``--reuse-freed-memory`` keeps freed memory in glibc's heap and plans cosmotrain's step
arrays, as ``cosmotrain train`` does by default (``device.reuse_freed_memory``,
``device.plan_step_memory``; ``--heap-only`` leaves out the plan); the heap setting is
process-wide, so PyTorch's side gets it
too (``cosmotrain/device/heap.py``).

``--check`` instead compares one PyTorch step's loss and gradients against the
one-process twin on the whole batch, and cosmotrain's first loss against the same
reference; exit status 1 when they differ (``tests/test_bench_ddp.py`` runs it on 2
ranks at W=16 and 32).
"""

from __future__ import annotations

import os

for _key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_key] = "1"  # before numpy loads OpenBLAS: one thread a rank, both sides

import argparse  # noqa: E402
import copy  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_hybrid import build_step, smooth_block, targets  # noqa: E402

from cosmotrain.config.load import load_config  # noqa: E402
from cosmotrain.config.schema import Config  # noqa: E402
from cosmotrain.device import step_memory  # noqa: E402
from cosmotrain.device.heap import reuse_freed_memory  # noqa: E402
from cosmotrain.kernels.compiled import choice as compiled_choice  # noqa: E402
from cosmotrain.kernels.cpu.workers import KernelThreads, configure_threads  # noqa: E402
from cosmotrain.models import build_model  # noqa: E402
from cosmotrain.nn.module import Context  # noqa: E402
from cosmotrain.tensor.dist_tensor import DistTensor  # noqa: E402
from cosmotrain.engine.step import HybridStep  # noqa: E402

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4  # float32, different summation orders


@dataclass
class Side:
    """One implementation's training step: ``prepare`` (untimed) then ``run`` -> loss."""

    name: str
    prepare: Callable[[], None]
    run: Callable[[], float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cosmoflow", "cosmoflow-mlperf"),
                        default="cosmoflow")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="global mini-batch")
    parser.add_argument("--strategy", choices=("N", "D"), default="N",
                        help="N: samples over the ranks; D: depth over the ranks")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median shown)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--interleave", action="store_true",
                        help="alternate cosmotrain and PyTorch steps")
    parser.add_argument("--reuse-freed-memory", action="store_true",
                        help="keep freed memory in glibc's heap (both sides, process-wide) "
                        "and plan cosmotrain's step arrays")
    parser.add_argument("--heap-only", action="store_true",
                        help="with --reuse-freed-memory: no planned step memory")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="extra config KEY=VALUE (repeatable); PyTorch's side takes "
                        "the model, batch and Adam settings from the same config")
    parser.add_argument("--check", action="store_true",
                        help="compare loss and gradients with the one-process twin, no timing")
    parser.add_argument("--no-direct", action="store_true",
                        help="GEMM lowerings only: no compiled direct convolution loops "
                        "(cosmotrain/kernels/compiled/direct.py), for A/B runs")
    args = parser.parse_args(argv)
    compiled_choice.USE_DIRECT = not args.no_direct
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def config_for(args: argparse.Namespace, ranks: int) -> Config:
    """The cosmotrain config of the run: the model, the batch and the layout."""
    sample, depth = (ranks, 1) if args.strategy == "N" else (1, ranks)
    if args.strategy == "N" and args.batch % ranks:
        raise SystemExit(f"bench_ddp: --batch {args.batch} does not split over {ranks} ranks")
    if args.strategy == "D" and args.width % ranks:
        raise SystemExit(f"bench_ddp: --width {args.width} does not split over {ranks} ranks")
    keys = [f"model.name={args.model}", f"model.width={args.width}",
            f"train.batch_size={args.batch}", f"parallel.sample={sample}",
            f"parallel.depth={depth}"]
    cfg = load_config(None, keys + list(args.overrides))
    if cfg.optimizer.name != "adam":
        raise SystemExit("bench_ddp: PyTorch's side runs Adam; keep optimizer.name=adam")
    return cfg


def init_gloo(world: Any) -> None:
    """torch.distributed over gloo on the MPI ranks (rank 0 picks the port)."""
    import torch.distributed as dist

    hosts = world.allgather(MPI.Get_processor_name())
    address = None
    if world.rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        address = ("127.0.0.1" if len(set(hosts)) == 1 else socket.gethostname(), port)
    host, port = world.bcast(address, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=world.rank,
                            world_size=world.size)


def twin_of(cfg: Config) -> Any:
    """The ``torch.nn`` twin of the model cosmotrain trains (same seed, same weights),
    activating before max-pooling as the MLPerf reference and a PyTorch user write it."""
    from torch_mirror import torch_twin

    model = build_model(cfg.model, cfg.train.seed)
    if "activation_first" in inspect.signature(torch_twin).parameters:
        return torch_twin(model, activation_first=True)
    return torch_twin(model)


def local_box(cfg: Config, strategy: str, rank: int, ranks: int) -> list[slice]:
    """The part of the global batch PyTorch's rank holds: its samples (N) or its depth
    slab of every sample (D)."""
    width, batch = cfg.model.width, cfg.train.batch_size
    box = [slice(0, batch), slice(0, cfg.model.channels)] + [slice(0, width)] * 3
    if strategy == "N":
        box[0] = slice(rank * batch // ranks, (rank + 1) * batch // ranks)
    else:
        box[2] = slice(rank * width // ranks, (rank + 1) * width // ranks)
    return box


@dataclass
class TorchRun:
    """PyTorch's side: the (wrapped) twin, this rank's inputs, the targets it scores."""

    model: Any
    twin: Any
    x: Any
    y: Any
    optimizer: Any
    after_backward: Callable[[], None]

    def gradients(self) -> float:
        """Forward, backward and the gradient reduction; the loss of this rank's rows."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.after_backward()
        return float(loss.item())

    def step(self) -> float:
        loss = self.gradients()
        self.optimizer.step()
        return loss


def torch_run(cfg: Config, strategy: str, stop: str, world: Any) -> TorchRun:
    """DDP over the twin (N) or the depth-split peer cut at cosmotrain's ``stop`` (D)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch_depth_split import DepthSplitPeer

    twin = twin_of(cfg)
    box = local_box(cfg, strategy, world.rank, world.size)
    x = torch.from_numpy(smooth_block(box))
    y = torch.from_numpy(targets(cfg.train.batch_size, cfg.model.outputs)[box[0]])
    opt = cfg.optimizer
    optimizer = torch.optim.Adam(twin.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                 eps=opt.eps)
    if strategy == "N":
        return TorchRun(DistributedDataParallel(twin), twin, x, y, optimizer, lambda: None)
    peer = DepthSplitPeer(twin, stop)
    return TorchRun(peer, twin, x, y, optimizer, peer.reduce_gradients)


def cosmotrain_side(step: HybridStep, x: DistTensor, y: np.ndarray) -> Side:
    """The trainer's step; each step gets a fresh copy of the input block (untimed)."""
    fresh: list[DistTensor] = []
    count = itertools.count()

    def prepare() -> None:
        fresh[:] = [DistTensor(x.data.copy(), x.dist, x.coord)]

    def run() -> float:
        return step(fresh.pop(), y, Context(step=next(count))).loss

    return Side("cosmotrain", prepare, run)


def measure(world: Any, sides: list[Side], steps: int, warmup: int, interleave: bool
            ) -> dict[str, tuple[list[float], float]]:
    """Per side: the slowest rank's seconds of each timed step, and the first loss."""
    seconds: dict[str, list[float]] = {side.name: [] for side in sides}
    first: dict[str, float] = {}
    order = [side for _ in range(warmup + steps) for side in sides] if interleave \
        else [side for side in sides for _ in range(warmup + steps)]
    for side in order:
        side.prepare()
        world.Barrier()
        start = time.perf_counter()
        loss = side.run()
        seconds[side.name].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
        first.setdefault(side.name, world.allreduce(loss) / world.size)
    return {name: (times[warmup:], first[name]) for name, times in seconds.items()}


def describe(args: argparse.Namespace, strategy: str, stop: str, heap: str) -> str:
    """The run in one comment line: the layout, the PyTorch side, threads, heap, steps."""
    peer = ("DistributedDataParallel" if args.strategy == "N" else
            f"depth-split peer (torch_depth_split.py; layers before {stop or 'none'} on "
            "slabs, as cosmotrain's spatial stop)")
    timing = "" if args.check else (f"; median of {args.steps} steps after {args.warmup} "
                                    f"warm-up{', interleaved' if args.interleave else ''}")
    return (f"# {args.model} W={args.width} batch {args.batch} {strategy}: PyTorch {peer} "
            f"over gloo; 1 thread a rank; glibc heap reuse {heap}{timing}")


def report(args: argparse.Namespace, world: Any, strategy: str,
           results: dict[str, tuple[list[float], float]]) -> None:
    """Rank 0: a markdown row, the first losses and every timed step."""
    if world.rank != 0:
        return
    ours, theirs = (statistics.median(results[k][0]) for k in ("cosmotrain", "torch"))
    batch = args.batch
    stamp, host = time.strftime("%Y-%m-%d %H:%M"), MPI.Get_processor_name()
    print("| model | W | global batch | strategy | P | cosmotrain s/step | cosmotrain "
          "samples/s | torch s/step | torch samples/s | torch / cosmotrain | date | host |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.model} | {args.width} | {batch} | {strategy} | {world.size} | "
          f"{ours:.3f} | {batch / ours:.3f} | {theirs:.3f} | {batch / theirs:.3f} | "
          f"**{theirs / ours:.2f}** | {stamp} | {host} |")
    print(f"first-step loss: cosmotrain {results['cosmotrain'][1]:.7g}, "
          f"torch {results['torch'][1]:.7g}")
    for name, (times, _) in results.items():
        print(f"{name} s/step: " + " ".join(f"{t:.3f}" for t in times))


def check(world: Any, cfg: Config, run: TorchRun, ours: Side) -> bool:
    """PyTorch's loss and gradients (one step) and cosmotrain's first loss against the
    one-process twin on the whole batch; prints on rank 0, the verdict on every rank."""
    import torch

    reference = copy.deepcopy(run.twin)
    batch, width = cfg.train.batch_size, cfg.model.width
    x = torch.from_numpy(smooth_block([slice(0, batch), slice(0, cfg.model.channels)]
                                      + [slice(0, width)] * 3))
    y = torch.from_numpy(targets(batch, cfg.model.outputs))
    want = torch.nn.functional.mse_loss(reference(x), y)
    want.backward()
    theirs = world.allreduce(run.gradients()) / world.size
    ours.prepare()
    mine = ours.run()
    expected = dict(reference.named_parameters())
    worst = max((float((p.grad - expected[n].grad).norm() / expected[n].grad.norm()), n)
                for n, p in run.twin.named_parameters())
    errors = {"torch loss": abs(theirs / want.item() - 1),
              "cosmotrain loss": abs(mine / want.item() - 1)}
    ok = max(errors.values()) <= LOSS_RTOL and worst[0] <= GRAD_RTOL
    ok = bool(world.allreduce(int(ok), op=MPI.MIN))
    if world.rank == 0:
        print(f"one-process twin loss {want.item():.7g}; torch {theirs:.7g}, cosmotrain "
              f"{mine:.7g} (relative {errors['torch loss']:.1e}, "
              f"{errors['cosmotrain loss']:.1e}); largest relative gradient difference "
              f"{worst[0]:.1e} ({worst[1]}): {'ok' if ok else 'FAILED'}")
    return ok


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        raise SystemExit("bench_ddp: needs torch (pip install torch, CPU) as the yardstick")
    world = MPI.COMM_WORLD
    heap = "on" if args.reuse_freed_memory and reuse_freed_memory() else "off"
    if heap == "on" and not args.heap_only and step_memory.install():
        heap += ", planned step memory"
    configure_threads(KernelThreads(1))
    torch.set_num_threads(1)
    cfg = config_for(args, world.size)
    step, x = build_step(world, cfg)
    init_gloo(world)
    strategy, stop = step.grid.layout.describe(), step.model.stop
    run = torch_run(cfg, args.strategy, stop, world)
    ours = cosmotrain_side(step, x, targets(args.batch, cfg.model.outputs))
    if world.rank == 0:
        print(describe(args, strategy, stop, heap), flush=True)
    if args.check:
        ok = check(world, cfg, run, ours)
        torch.distributed.destroy_process_group()
        sys.exit(0 if ok else 1)
    theirs = Side("torch", lambda: None, run.step)
    results = measure(world, [ours, theirs], args.steps, args.warmup, args.interleave)
    report(args, world, strategy, results)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
