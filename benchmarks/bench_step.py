"""Whole cosmotrain training steps on a device, in samples/s, beside PyTorch's.

    [mpiexec -n P] python benchmarks/bench_step.py [--backend gpu] [--width 128]
        [--batch 1 8 32] [--precisions fp32 tf32 bf16] [--algorithms cudnn gemm]
        [--steps 10] [--warmup 3] [--set KEY=VALUE ...] [--input host|stored|device]
        [--torch-layouts ndhwc ncdhw] [--no-torch] [--out FILE.json]

What is timed: the trainer's own step (``HybridStep``: the batch's host -> device copy,
forward, loss, backward, gradient reduction, Adam) of the default ``cosmoflow`` network at
width W, for every batch, precision and (on the GPU) convolution algorithm, built from the
config exactly as ``cosmotrain train`` builds it (``--set`` adds keys: a spatial split,
``parallel.depth=2``, with several ranks sharing one GPU through host staging).  The
device is synchronised after every step, so a step's time is all of its work; the figure
is the median over ``--steps`` after ``--warmup``, of the slowest rank.

Columns: samples/s (global batch / step), samples/s per device (ranks sharing a GPU count
as one device), and the memory a rank held at its step's peak: cupy's pool after the
step (the pool keeps freed blocks, so it bounds the peak from above) or, on the CPU, the
process's peak resident set.  PyTorch's whole step of the same network (eager, Adam;
bf16 through ``torch.autocast`` with fp32 master weights, TF32 through ``allow_tf32``) runs
on the same device when ``import torch`` works there (one rank only), in each memory
layout of ``--torch-layouts`` (``ndhwc``: channels-last) with cuDNN's autotuner on.

``--input host`` (the default) starts each step from a batch in host memory, as training
does: cosmotrain's step copies it to the device (from pageable memory), PyTorch's from
pinned memory with ``non_blocking=True`` (a ``DataLoader(pin_memory=True)``'s batch).
``--input stored`` starts cosmotrain's step from int16 counts in host memory, as training
from an int16 dataset on a GPU does: staged through pinned buffers and transformed on the
device (``engine/input_stage.py``; on the CPU the step transforms them on the host);
PyTorch's batch as with ``host``.
``--input device`` starts both from a batch already on the device: the compute alone.

``--backend cpu`` runs the same code on numpy (how ``tests/test_bench_step.py`` checks
this script without a GPU); ``--backend gpu`` without cupy or a device exits 2 with the
reason, as ``cosmotrain train`` would.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_hybrid import build_step, targets  # noqa: E402

from cosmotrain.runtime.threads import job_threads  # noqa: E402
from cosmotrain.config.load import load_config  # noqa: E402
from cosmotrain.data.readers.transform import DeviceTransform  # noqa: E402
from cosmotrain.device import step_memory  # noqa: E402
from cosmotrain.kernels.cpu.workers import KernelThreads  # noqa: E402
from cosmotrain.errors import UserError  # noqa: E402
from cosmotrain.nn.module import Context  # noqa: E402
from cosmotrain.nn.profile import LayerTimer  # noqa: E402
from cosmotrain.tensor.dist_tensor import DistTensor  # noqa: E402
from cosmotrain.engine.step import HybridStep  # noqa: E402

PRECISIONS = ("fp32", "tf32", "bf16")


def overrides(args: argparse.Namespace, batch: int, precision: str, algorithm: str,
              graph: bool = False) -> List[str]:
    """The config of one row: the model, batch and device keys, then the user's ``--set``.
    ``graph``: the step captured as a CUDA graph within the warm-up steps (the capture
    is never timed), else never captured."""
    keys = [f"model.width={args.width}", f"train.batch_size={batch}",
            f"device.backend={args.backend}", f"device.precision={precision}"]
    if args.backend == "gpu":
        keys.append(f"device.conv_algorithm={algorithm}")
        keys.append(f"device.cuda_graph={'true' if graph else 'false'}")
        if graph:
            keys.append(f"device.cuda_graph_warmup={graph_warmup(args)}")
    return keys + list(args.overrides)


def graph_warmup(args: argparse.Namespace) -> int:
    """Eager steps before the capture: the capture is the last warm-up step."""
    return max(2, args.warmup - 1)


def row_variants(args: argparse.Namespace) -> List[tuple[str, bool]]:
    """``(algorithm, graph)`` of each cosmotrain row: a graph needs cuDNN's convolutions
    (gemm's cuBLAS cannot be captured) and a warm-up long enough to capture in."""
    if args.backend != "gpu":
        return [("numpy", False)]
    graphs = [mode == "on" for mode in args.graph]
    return [(algorithm, graph) for algorithm in args.algorithms for graph in graphs
            if not graph or (algorithm == "cudnn" and args.warmup > graph_warmup(args))]


def synchronizer(step: HybridStep) -> Callable[[], None]:
    """Waits for the rank's device to finish its queued work (nothing to wait for on the
    CPU)."""
    if not step.device.is_gpu:
        return lambda: None
    return step.device.xp.cuda.Device().synchronize


def stored_input(x: DistTensor) -> tuple[DistTensor, DeviceTransform]:
    """``--input stored``: int16 particle counts in the block's shape, with the log1p the
    step applies to them on its device."""
    counts = np.random.default_rng(5).poisson(2.0, size=x.data.shape).astype(np.int16)
    return DistTensor(counts, x.dist, x.coord), DeviceTransform("log1p")


def time_steps(step: HybridStep, x: DistTensor, y: np.ndarray, steps: int, warmup: int,
               world: Any, on_device: bool = False,
               transform: Optional[DeviceTransform] = None) -> List[float]:
    """Seconds of each timed step on the slowest rank (every step starts on a barrier).

    Each step gets a fresh copy of the input block, made before the clock starts (a
    step may write into its input).  ``on_device``: the copy is on the rank's device,
    as PyTorch's batch is, and the step's input placement has nothing to move; else the
    block comes from host memory and the step includes its host -> device copy, as in
    training.  ``transform``: the block holds int16 counts the step transforms
    (``--input stored``)."""
    sync = synchronizer(step)
    if on_device:
        x = step.place_input(x)
    seconds = []
    for index in range(warmup + steps):
        # the copy is made and freed inside the step's planned memory, as the trainer
        # reads and frees its batch (device/step_memory.py)
        with step_memory.phase("train"):
            fresh = DistTensor(x.data.copy(), x.dist, x.coord)
            sync()
            world.Barrier()
            started = time.perf_counter()
            step(fresh, y, Context(step=index), transform=transform)
            sync()
            elapsed = world.allreduce(time.perf_counter() - started, op=MPI.MAX)
            del fresh
        if index >= warmup:
            seconds.append(elapsed)
    return seconds


def peak_memory_mib(step: HybridStep) -> float:
    """Bytes held at the step's peak, in MiB: cupy's pool on a GPU (an upper bound: it keeps
    freed blocks), the peak resident set of the process on the CPU."""
    if step.device.is_gpu:
        return step.device.xp.get_default_memory_pool().total_bytes() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def devices_used(step: HybridStep, world: Any) -> int:
    """GPUs the job runs on (ranks bound to one GPU count once); ranks on the CPU."""
    if not step.device.is_gpu:
        return world.Get_size()
    return len({index for index in world.allgather((MPI.Get_processor_name(),
                                                     step.device.index))})


def cosmotrain_row(world: Any, args: argparse.Namespace, batch: int, precision: str,
                   algorithm: str, threads: KernelThreads, graph: bool = False
                   ) -> Dict[str, Any]:
    """One timed configuration; 'out of memory' when it does not fit."""
    impl = f"cosmotrain {algorithm}{' graph' if graph else ''}"
    row: Dict[str, Any] = {"impl": impl if args.backend == "gpu" else "cosmotrain numpy",
                           "batch": batch, "precision": precision}
    try:
        cfg = load_config(None, overrides(args, batch, precision, algorithm, graph))
        step, x = build_step(world, cfg, threads)
        x, transform = stored_input(x) if args.input == "stored" else (x, None)
        seconds = time_steps(step, x, targets(batch, cfg.model.outputs), args.steps,
                             args.warmup, world, on_device=args.input == "device",
                             transform=transform)
    except MemoryError:
        return {**row, "status": "out of memory"}
    except UserError as err:
        if not graph:
            raise
        return {**row, "status": f"not captured: {err}"}  # e.g. a layout over staging MPI
    except Exception as err:  # noqa: BLE001 - cupy's OutOfMemoryError without importing it
        if type(err).__name__ != "OutOfMemoryError":
            raise
        return {**row, "status": "out of memory"}
    median = statistics.median(seconds)
    devices = devices_used(step, world)
    memory = world.gather(peak_memory_mib(step), root=0)
    strategy = step.grid.layout.describe()
    layers = (layer_times(step, x, targets(batch, cfg.model.outputs), args, world, transform)
              if args.layers else None)
    del step
    release_device_memory(args.backend)
    return {**row, "status": "ok", "step_s": median, "samples_per_s": batch / median,
            "devices": devices, "samples_per_s_per_device": batch / median / devices,
            "ranks": world.Get_size(), "memory_mib_max": max(memory) if memory else None,
            "strategy": strategy,
            "step_times_s": seconds, **({"layers_ms": layers} if layers else {})}


def layer_times(step: HybridStep, x: DistTensor, y: np.ndarray, args: argparse.Namespace,
                world: Any, transform: Optional[DeviceTransform] = None
                ) -> Dict[str, float]:
    """Milliseconds per step of each layer's forward and backward (``--layers``), the
    device synchronised around each, and what the step spends outside the layers (input
    placement, loss, gradient reduction, optimizer).  Measured after the timed steps, so
    the synchronisation does not slow the figures above."""
    model = step.model
    timer = LayerTimer(model.spatial, model.to_samples, model.head, sync=synchronizer(step))
    try:
        seconds = time_steps(step, x, y, args.steps, 0, world,  # warm from the timed steps
                             on_device=args.input == "device", transform=transform)
    finally:
        timer.remove()
    per_step = {f"{name} {phase}": 1e3 * total / args.steps
                for (name, phase), total in timer.seconds.items()}
    per_step["outside the layers"] = max(
        0.0, 1e3 * statistics.mean(seconds) - sum(per_step.values()))
    return per_step


def release_device_memory(backend: str) -> None:
    """Return cupy's cached blocks between rows, so each row's peak is its own."""
    if backend == "gpu":
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()


def torch_row(args: argparse.Namespace, model: Any, batch: int, precision: str,
              layout: str) -> Optional[Dict[str, Any]]:
    """PyTorch's whole step of the same network on the same device (None without torch).

    Run as its users run it for speed: cuDNN's autotuner on, bf16 through autocast, and
    on the GPU either memory layout (``ndhwc`` is channels-last, the faster one for
    tensor cores)."""
    try:
        import torch
    except ImportError:
        return None
    device = "cuda" if args.backend == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return None
    if device == "cpu" and precision == "tf32":
        return None
    from torch_mirror import torch_twin

    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = True
    memory_format = (torch.channels_last_3d if layout == "ndhwc"
                     else torch.contiguous_format)
    twin = torch_twin(model).to(device, memory_format=memory_format)
    opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    x = torch.randn(batch, model.items[0].in_channels, args.width, args.width, args.width,
                    device=device).contiguous(memory_format=memory_format)
    y = torch.randn(batch, 4, device=device)

    host = (x.cpu().pin_memory() if args.input in ("host", "stored") and device == "cuda"
            else None)

    def step() -> None:
        # --input host: the batch crosses to the GPU each step, from pinned memory and
        # asynchronously, as a DataLoader(pin_memory=True) feeds a training loop
        batch = x if host is None else host.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = ((twin(batch).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    seconds = []
    for index in range(args.warmup + args.steps):
        started = time.perf_counter()
        step()
        if index >= args.warmup:
            seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    return {"impl": f"torch {layout}" if device == "cuda" else "torch", "batch": batch, "precision": precision, "status": "ok",
            "step_s": median, "samples_per_s": batch / median, "devices": 1,
            "samples_per_s_per_device": batch / median, "ranks": 1}


def measure(world: Any, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Every row: cosmotrain per algorithm, then PyTorch, per (batch, precision).

    The model PyTorch's twin copies is built only for PyTorch's rows: built before them,
    its parameters would count in every cosmotrain row's peak resident set."""
    rows = []
    model = None
    threads = job_threads(world)  # applied with the heap setting by each step's job runtime
    for batch in args.batch:
        for precision in args.precisions:
            if precision == "tf32" and args.backend == "cpu":
                continue  # TF32 is a tensor-core mode: the CPU refuses it
            for algorithm, graph in row_variants(args):
                rows.append(cosmotrain_row(world, args, batch, precision, algorithm,
                                           threads, graph))
                report(world, rows[-1])
            if not args.no_torch and world.Get_size() == 1:
                model = model if model is not None else torch_model(args)
                layouts = args.torch_layouts if args.backend == "gpu" else ["ncdhw"]
                for layout in layouts:
                    row = torch_row(args, model, batch, precision, layout)
                    if row is not None:
                        rows.append(row)
                        report(world, row)
    return rows


def torch_model(args: argparse.Namespace) -> Any:
    """The benchmarked network (``--width`` and any ``--set model.*`` key), whose weights
    PyTorch's twin copies."""
    from cosmotrain.models import build_model

    keys = [f"model.width={args.width}",
            *(key for key in args.overrides if key.startswith("model."))]
    return build_model(load_config(None, keys).model, 0)


def report(world: Any, row: Dict[str, Any]) -> None:
    if world.Get_rank() != 0:
        return
    if row["status"] != "ok":
        print(f"{row['impl']:18} batch {row['batch']:3} {row['precision']}: {row['status']}",
              flush=True)
        return
    memory = f", {row['memory_mib_max']:.0f} MiB/rank" if row.get("memory_mib_max") else ""
    print(f"{row['impl']:18} batch {row['batch']:3} {row['precision']}: "
          f"{row['step_s'] * 1e3:9.1f} ms, {row['samples_per_s']:8.2f} samples/s, "
          f"{row['samples_per_s_per_device']:8.2f} per device{memory}", flush=True)
    for name, ms in row.get("layers_ms", {}).items():
        print(f"    {name:32} {ms:9.2f} ms", flush=True)


def markdown(rows: List[Dict[str, Any]]) -> str:
    """Samples/s per device: one line per (batch, precision), one column per implementation."""
    columns = list(dict.fromkeys(r["impl"] for r in rows))
    keys = list(dict.fromkeys((r["batch"], r["precision"]) for r in rows))
    found = {(r["impl"], r["batch"], r["precision"]): r for r in rows}
    lines = ["| batch | precision | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for batch, precision in keys:
        cells = []
        for impl in columns:
            r = found.get((impl, batch, precision))
            cells.append("" if r is None else r["status"] if r["status"] != "ok"
                         else f"{r['samples_per_s_per_device']:.2f}")
        lines.append(f"| {batch} | {precision} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cpu", "gpu"], default="gpu")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--algorithms", nargs="+", default=["cudnn", "gemm"],
                        choices=["cudnn", "gemm"], help="GPU convolutions")
    parser.add_argument("--graph", nargs="+", choices=["off", "on"], default=["off", "on"],
                        help="GPU: rows without and with the step captured as a CUDA "
                             "graph (device.cuda_graph; cudnn rows only)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median shown)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config KEY=VALUE, e.g. parallel.depth=2 (repeatable)")
    parser.add_argument("--input", choices=["host", "stored", "device"], default="host",
                        help="where each step's batch starts: host memory (the step copies "
                        "it to the device), int16 counts in host memory (the trainer's "
                        "case with int16 data: staged and transformed on the device) or "
                        "already on the device")
    parser.add_argument("--layers", action="store_true",
                        help="also time each layer's forward and backward (device "
                        "synchronised around each), in extra steps after the timed ones")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-layouts", nargs="+", default=["ndhwc", "ncdhw"],
                        choices=["ndhwc", "ncdhw"],
                        help="PyTorch's memory layouts on the GPU (ndhwc: channels-last)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    try:
        rows = measure(world, args)
    except UserError as err:  # e.g. --backend gpu without cupy or a device
        if world.Get_rank() == 0:
            print(f"bench_step: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    if world.Get_rank() != 0:
        return
    name = next((key.split("=", 1)[1] for key in args.overrides
                 if key.startswith("model.name=")), "cosmoflow")
    print(f"\nsamples/s per device, {name} W={args.width}, {world.Get_size()} rank(s), "
          f"backend {args.backend}\n")
    print(markdown(rows))
    if args.out:
        payload = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": MPI.Get_processor_name(),
                   "args": {k: (str(v) if isinstance(v, Path) else v)
                            for k, v in vars(args).items()}, "results": rows}
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
