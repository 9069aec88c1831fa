"""CosmoFlow training step (forward + backward + Adam update) on one process: cosmotrain
against PyTorch CPU eager (the same network, the same weights) in the same run.

    python benchmarks/bench_cosmoflow.py --width 128 --batch 1 4 [--repeats 3] [--no-torch]
        [--model cosmoflow-mlperf] [--interleave] [--stat best|median] [--no-memory]

Prints seconds per step and per sample, effective GFLOP/s, the ratio to PyTorch, a
per-layer breakdown (forward / backward), and the peak memory of one cosmotrain step
against the activations + gradients the network needs.  Results for docs/PERFORMANCE.md.
By default all cosmotrain steps run, then all PyTorch steps, and the best is shown;
``--interleave`` alternates them step by step (on a shared machine both sides then meet
the same load) and ``--stat median`` shows the median step.  ``--reuse-freed-memory``
keeps freed memory in glibc's heap for the whole process, PyTorch included (see
``cosmotrain/device/heap.py``), and places cosmotrain's step arrays by plan
(``cosmotrain/device/step_memory.py``; numpy's arrays only): the trainer's defaults.
``--heap-only`` leaves out the plan.  ``--fusion-pair`` times
cosmotrain alone with its activations fused into the convolutions against not,
alternating step by step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Callable

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cosmotrain.device import step_memory  # noqa: E402
from cosmotrain.device.heap import reuse_freed_memory  # noqa: E402

from cosmotrain.config.schema import ModelConfig  # noqa: E402
from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import choice as compiled_choice  # noqa: E402
from cosmotrain.kernels.loss import mse_backward, mse_sum  # noqa: E402
from cosmotrain.models import build_model  # noqa: E402
from cosmotrain.nn import containers  # noqa: E402
from cosmotrain.nn.module import Context  # noqa: E402
from cosmotrain.nn.profile import LayerTimer  # noqa: E402
from cosmotrain.plan.flops import training_flops  # noqa: E402
from cosmotrain.plan.memory import training_memory  # noqa: E402
from cosmotrain.engine.optim import Adam  # noqa: E402


def make_batch(batch: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.log1p(rng.poisson(3.0, size=(batch, 4, width, width, width))).astype(np.float32)
    return x, rng.uniform(-1, 1, size=(batch, 4)).astype(np.float32)


def cosmotrain_step(model, opt: Adam, x: np.ndarray, y: np.ndarray) -> float:
    ctx = Context(training=True, global_batch=x.shape[0])
    pred = model.forward(x, ctx)
    loss = mse_sum(pred, y) / pred.size
    model.backward(mse_backward(pred, y, pred.size), ctx)
    opt.step(model.named_parameters())
    opt.zero_grad(model.named_parameters())
    return loss


def cosmotrain_stepper(model, x: np.ndarray, y: np.ndarray
                       ) -> tuple[Callable[[], float], LayerTimer]:
    """A timed step of ``model`` (after two warm-up steps) and its per-layer timer.

    The first warm-up step allocates the optimizer state; under planned step memory it
    runs unplanned and the second on its plan (or is planned again), so that the timed
    steps are the trainer's steady state."""
    opt = Adam(lr=1e-4)

    def step() -> float:
        with step_memory.phase("train"):  # planned when installed, as the trainer's
            batch = x.copy()
            start = time.perf_counter()
            cosmotrain_step(model, opt, batch, y)
            seconds = time.perf_counter() - start
            del batch
        return seconds

    step()
    step()
    return step, LayerTimer(model)


def sgemm_stepper(size: int = 2048) -> Callable[[], float]:
    """Seconds of one float32 ``size``^3 ``numpy.matmul`` (the sgemm rate the issue's
    share is of: benchmarks/sgemm_rate.py), timed between the steps it is compared with."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    c = np.empty_like(a)
    np.matmul(a, b, out=c)

    def run() -> float:
        start = time.perf_counter()
        np.matmul(a, b, out=c)
        return time.perf_counter() - start

    return run


def run_steps(steppers: dict, repeats: int, interleave: bool) -> dict:
    """Step times of every stepper: all of one then the next, or alternating."""
    times: dict = {name: [] for name in steppers}
    if interleave:
        for _ in range(repeats):
            for name, step in steppers.items():
                times[name].append(step())
    else:
        for name, step in steppers.items():
            times[name] = [step() for _ in range(repeats)]
    return times


def fusion_pair(model, x: np.ndarray, y: np.ndarray, repeats: int) -> dict:
    """Step times of one model with its activations fused into the convolutions and not
    (``nn.containers.FUSE_ACTIVATIONS``), alternating step by step: the same bits, so
    the same work but for the activations' own passes."""
    step, timer = cosmotrain_stepper(model, x, y)
    timer.remove()

    def with_fusion(fuse: bool) -> Callable[[], float]:
        def run() -> float:
            containers.FUSE_ACTIVATIONS = fuse
            try:
                return step()
            finally:
                containers.FUSE_ACTIVATIONS = True
        return run

    return run_steps({"unfused": with_fusion(False), "fused": with_fusion(True)}, repeats,
                     interleave=True)


def peak_step_memory(model, x: np.ndarray, y: np.ndarray) -> int:
    """Bytes allocated at the peak of one step beyond what existed before it."""
    opt = Adam(lr=1e-4)
    cosmotrain_step(model, opt, x.copy(), y)
    batch = x.copy()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    cosmotrain_step(model, opt, batch, y)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak - base


def torch_stepper(model, x: np.ndarray, y: np.ndarray, threads: int = 2):
    """``(timed step, per-layer seconds, hooks)`` of the ``torch.nn`` twin (after a
    warm-up step), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    from torch_mirror import torch_twin

    torch.set_num_threads(threads)
    twin = torch_twin(model, activation_first=True)  # as the MLPerf reference writes it
    opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    seconds, hooks = _torch_layer_hooks(twin)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ((twin(tx) - ty) ** 2).mean()
        loss.backward()
        opt.step()
        return time.perf_counter() - start

    step()
    seconds.clear()
    return step, seconds, hooks


def _torch_layer_hooks(twin):
    """Forward/backward wall time per leaf module via hooks (approximate, like ours)."""
    from collections import defaultdict

    seconds: dict[tuple[str, str], float] = defaultdict(float)
    starts: dict[tuple[str, str], float] = {}
    hooks = []
    from torch_mirror import CountPadAvgPool

    for name, module in twin.named_modules():
        inside_pool = name.endswith((".native", ".unpadded"))
        if inside_pool or (list(module.children()) and not isinstance(module, CountPadAvgPool)):
            continue

        def pre(phase, key=name):
            def hook(*_):
                starts[(key, phase)] = time.perf_counter()
            return hook

        def post(phase, key=name):
            def hook(*_):
                seconds[(key, phase)] += time.perf_counter() - starts[(key, phase)]
            return hook

        hooks += [module.register_forward_pre_hook(pre("forward")),
                  module.register_forward_hook(post("forward")),
                  module.register_full_backward_pre_hook(pre("backward")),
                  module.register_full_backward_hook(post("backward"))]
    return seconds, hooks


def layer_table(ours: LayerTimer, theirs: dict | None) -> list[str]:
    names = list(dict.fromkeys(name for name, _ in ours.seconds))
    lines = ["| layer | fwd ms | bwd ms | torch fwd ms | torch bwd ms |", "|---|---|---|---|---|"]
    for name in names:
        # an activation run inside its neighbour (nn/containers.py, FUSE_ACTIVATIONS) has
        # no call of its own that way: its time is in the convolution's row
        f = ours.seconds.get((name, "forward"), 0.0) * 1e3
        b = ours.seconds.get((name, "backward"), 0.0) * 1e3
        if f + b < 0.5:
            continue
        tf = tb = float("nan")
        if theirs is not None:
            tf = theirs.get((name, "forward"), float("nan")) * 1e3
            tb = theirs.get((name, "backward"), float("nan")) * 1e3
        lines.append(f"| {name} | {f:.1f} | {b:.1f} | {tf:.1f} | {tb:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--model", default="cosmoflow")
    parser.add_argument("--interleave", action="store_true",
                        help="alternate cosmotrain and PyTorch steps")
    parser.add_argument("--stat", choices=("best", "median"), default="best")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    parser.add_argument("--reuse-freed-memory", action="store_true",
                        help="keep freed memory in glibc's heap and plan the step's "
                        "arrays (see the module docstring)")
    parser.add_argument("--sgemm-share", action="store_true",
                        help="time numpy's 2048^3 sgemm between the steps (interleaved "
                        "with them under --interleave) and print the step's share of it")
    parser.add_argument("--heap-only", action="store_true",
                        help="with --reuse-freed-memory: no planned step memory")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads of each side (cosmotrain: BLAS and kernel workers); 1 "
                        "is what each rank of the 2-rank bench_ddp.py runs")
    parser.add_argument("--fusion-pair", action="store_true",
                        help="only cosmotrain, activations fused into the convolutions "
                        "against not, alternating step by step (nn/containers.py)")
    parser.add_argument("--no-direct", action="store_true",
                        help="GEMM lowerings only: no compiled direct convolution loops "
                        "(cosmotrain/kernels/compiled/direct.py), for A/B runs")
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    compiled_choice.USE_DIRECT = not args.no_direct
    workers.set_blas_threads(args.threads)
    if args.reuse_freed_memory:
        print(f"# glibc heap reuse: {'on' if reuse_freed_memory() else 'not available'}")
        if not args.heap_only:
            print("# planned step memory: "
                  f"{'on' if step_memory.install() else 'not available'}")
    print(f"# {args.model} W={args.width} on {platform.node()} ({platform.processor() or 'cpu'})"
          f", numpy {np.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, {args.stat} of "
          f"{args.repeats}{' interleaved' if args.interleave else ''}")
    pick = min if args.stat == "best" else statistics.median
    for batch in args.batch:
        model = build_model(ModelConfig(name=args.model, width=args.width), seed=0)
        x, y = make_batch(batch, args.width)
        if args.fusion_pair:
            times = fusion_pair(model, x, y, args.repeats)
            a, b = pick(times["unfused"]), pick(times["fused"])
            print(f"batch {batch}: unfused {a:.3f} s/step, fused {b:.3f} s/step, "
                  f"ratio {a / b:.3f}")
            continue
        _, flops = training_flops(model, x.shape)
        steppers = {"ours": cosmotrain_stepper(model, x, y)}
        if args.sgemm_share:  # before PyTorch's step, whose idle threads spin a while
            steppers["sgemm"] = (sgemm_stepper(), None)
        torch_side = None if args.no_torch else torch_stepper(model, x, y, args.threads)
        if torch_side is not None:
            steppers["torch"] = torch_side
        times = run_steps({k: v[0] for k, v in steppers.items()}, args.repeats,
                          args.interleave)
        timer = steppers["ours"][1]
        timer.remove()
        ours = pick(times["ours"])
        line = (f"batch {batch}: cosmotrain {ours:.3f} s/step, {batch / ours:.3f} samples/s, "
                f"{flops / ours / 1e9:.0f} GFLOP/s ({flops / batch / 1e9:.1f} GFLOP/sample)")
        theirs = None
        if torch_side is not None:
            for hook in torch_side[2]:
                hook.remove()
            t = pick(times["torch"])
            theirs = {k: v / args.repeats for k, v in torch_side[1].items()}
            line += (f"; torch {t:.3f} s/step, {batch / t:.3f} samples/s; "
                     f"ratio torch/cosmotrain = {t / ours:.2f}")
        if args.sgemm_share:
            rate = 2 * 2048 ** 3 / pick(times["sgemm"])
            line += (f"; sgemm {rate / 1e9:.0f} GFLOP/s, share "
                     f"{flops / ours / rate:.0%}")
        print(line)
        print("steps s: " + "; ".join(f"{k} " + " ".join(f"{v:.3f}" for v in vals)
                                      for k, vals in times.items()))
        for key in timer.seconds:
            timer.seconds[key] /= args.repeats
        print("\n".join(layer_table(timer, theirs)))
        if args.no_memory:
            continue
        peak = peak_step_memory(model, x, y)
        need = training_memory(model, x.shape)
        print(f"peak step memory {peak / 2**20:.0f} MiB; activations + gradients needed "
              f"{need.step_bytes / 2**20:.0f} MiB (ratio {peak / need.step_bytes:.2f})")


if __name__ == "__main__":
    main()
