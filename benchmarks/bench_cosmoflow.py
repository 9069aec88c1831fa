"""CosmoFlow training step (forward + backward + Adam update) on one process: cosmotrain
against PyTorch CPU eager (the same network, the same weights) in the same run.

    python benchmarks/bench_cosmoflow.py --width 128 --batch 1 4 [--repeats 3] [--no-torch]

Prints seconds per step and per sample, effective GFLOP/s, the ratio to PyTorch, a
per-layer breakdown (forward / backward), and the peak memory of one cosmotrain step
against the activations + gradients the network needs.  Results for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cosmotrain.config.schema import ModelConfig  # noqa: E402
from cosmotrain.kernels.loss import mse_backward, mse_sum  # noqa: E402
from cosmotrain.models import build_model  # noqa: E402
from cosmotrain.nn.module import Context  # noqa: E402
from cosmotrain.nn.profile import LayerTimer  # noqa: E402
from cosmotrain.plan.flops import training_flops  # noqa: E402
from cosmotrain.plan.memory import training_memory  # noqa: E402
from cosmotrain.train.optim import Adam  # noqa: E402


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


def time_cosmotrain(model, x: np.ndarray, y: np.ndarray, repeats: int
                    ) -> tuple[float, LayerTimer]:
    opt = Adam(lr=1e-4)
    cosmotrain_step(model, opt, x.copy(), y)  # warm-up: allocates the optimizer state
    timer = LayerTimer(model)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cosmotrain_step(model, opt, x.copy(), y)
        times.append(time.perf_counter() - start)
    timer.remove()
    for key in timer.seconds:
        timer.seconds[key] /= repeats
    return min(times), timer


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


def time_torch(model, x: np.ndarray, y: np.ndarray, repeats: int
               ) -> tuple[float, dict[tuple[str, str], float]] | None:
    try:
        import torch
    except ImportError:
        return None
    from torch_mirror import torch_twin

    torch.set_num_threads(2)
    twin = torch_twin(model)
    opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    seconds, hooks = _torch_layer_hooks(twin)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = ((twin(tx) - ty) ** 2).mean()
        loss.backward()
        opt.step()

    step()
    seconds.clear()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    for hook in hooks:
        hook.remove()
    return min(times), {k: v / repeats for k, v in seconds.items()}


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
        f, b = ours.seconds[(name, "forward")] * 1e3, ours.seconds[(name, "backward")] * 1e3
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
    args = parser.parse_args()
    print(f"# {args.model} W={args.width} on {platform.node()} ({platform.processor() or 'cpu'})"
          f", numpy {np.__version__}, {time.strftime('%Y-%m-%d')}")
    for batch in args.batch:
        model = build_model(ModelConfig(name=args.model, width=args.width), seed=0)
        x, y = make_batch(batch, args.width)
        _, flops = training_flops(model, x.shape)
        ours, timer = time_cosmotrain(model, x, y, args.repeats)
        theirs = None if args.no_torch else time_torch(model, x, y, args.repeats)
        line = (f"batch {batch}: cosmotrain {ours:.3f} s/step, {ours / batch:.3f} s/sample, "
                f"{flops / ours / 1e9:.0f} GFLOP/s")
        if theirs is not None:
            line += (f"; torch {theirs[0]:.3f} s/step, {theirs[0] / batch:.3f} s/sample; "
                     f"ratio torch/cosmotrain = {theirs[0] / ours:.2f}")
        print(line)
        print("\n".join(layer_table(timer, theirs[1] if theirs else None)))
        peak = peak_step_memory(model, x, y)
        need = training_memory(model, x.shape)
        print(f"peak step memory {peak / 2**20:.0f} MiB; activations + gradients needed "
              f"{need.step_bytes / 2**20:.0f} MiB (ratio {peak / need.step_bytes:.2f})")


if __name__ == "__main__":
    main()
