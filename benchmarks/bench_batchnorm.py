"""Batch norm on one GPU: our kernels (kernels/cuda/src/batchnorm.cu) against the cupy
path they replace, at the 3D ResNet's shapes.

    python benchmarks/bench_batchnorm.py [--width 128] [--batch 8] [--base 16]
        [--precisions fp32 bf16] [--repeats 20] [--out results.json]

What is timed: one batch-norm layer's training forward (the per-channel sums, the
statistics, the running statistics' update, the normalisation keeping xhat) and backward (the two sums, the input gradient) at the
ResNet's four stages (``base`` x 2^s channels at W / 2^s, batch ``--batch``), each the
median of ``--repeats`` runs timed by CUDA events after one warm-up (which compiles).
"ours" is ``kernels/batchnorm.py``'s device route as it is now; "cupy" the route it
replaced (:func:`cupy_forward`, :func:`cupy_backward`: cupy's sum and the fused
``ReductionKernel`` / ``ElementwiseKernel`` of ``kernels/cuda/fused.py``, bf16 widened
to float32 and the results narrowed back).  Beside each: the compulsory bytes of our
passes (forward: x read twice, y and xhat written; backward: dy and xhat read twice, dx
written) and the rate that makes, and the largest difference between the two routes'
outputs (bf16: within one rounding; float32: the float64 sums' order at most).

Prints a markdown table; ``--out`` writes it as JSON.  Needs cupy and a CUDA device
(exit code 2 with a message otherwise); tests/test_bench_batchnorm.py runs :func:`rows`
on the stand-in cupy (tests/standin.py) at tiny sizes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.device.xp import array_module, to_host
from cosmotrain.kernels import batchnorm as bn
from cosmotrain.kernels.cuda import fused
from cosmotrain.precision import bfloat16, is_bf16, narrow, widen

EPS = 1e-5
MOMENTUM = 0.1
Timer = Callable[[Any, Callable[[], Any], int], float]


def shapes(width: int, batch: int, base: int) -> list[tuple[int, ...]]:
    """The ResNet's batch-norm inputs, one per stage (models/resnet3d.py)."""
    return [(batch, base * 2 ** s, *(max(width >> s, 1),) * 3) for s in range(4)]


def _per_channel(v: Any) -> Any:
    return v.reshape(1, -1, 1, 1, 1)


def cupy_forward(x: Any, gamma: Any, beta: Any, running: dict[str, Any]
                 ) -> tuple[Any, Any, Any, Any]:
    """The device route before batchnorm.cu, as a layer ran it: ``(y, xhat, inv_std,
    sums)``, the running statistics' rule applied (new arrays, as the layer bound)."""
    wide, xp = widen(x), array_module(x)
    sums = wide.sum(axis=fused.AXES, dtype=np.float64)
    stacked = xp.stack([sums, fused.channel_sum_squares(wide),
                        xp.full_like(sums, wide.size // wide.shape[1])])
    mean, var = bn.bn_statistics(stacked)
    count = stacked[2][0]
    unbiased = var * (count / xp.maximum(count - 1.0, 1.0))
    running["running_mean"] = ((1 - MOMENTUM) * running["running_mean"]
                               + MOMENTUM * mean).astype(np.float32)
    running["running_var"] = ((1 - MOMENTUM) * running["running_var"]
                              + MOMENTUM * unbiased).astype(np.float32)
    inv_std = (1.0 / xp.sqrt(var + EPS)).astype(np.float32)
    xhat, y = fused.bn_forward(wide, *(_per_channel(v.astype(np.float32))
                                       for v in (mean, inv_std, gamma, beta)))
    if is_bf16(x):
        y, xhat = narrow(y), narrow(xhat)
    return y, xhat, inv_std, stacked


def cupy_backward(dy: Any, xhat: Any, gamma: Any, inv_std: Any, count: Any) -> Any:
    """The device route's backward before batchnorm.cu: ``dx``."""
    wide_dy, wide_xhat = widen(dy), widen(xhat)
    sum_dy = wide_dy.sum(axis=fused.AXES, dtype=np.float64)
    sum_dy_xhat = fused.channel_sum_products(wide_dy, wide_xhat)
    dx = fused.bn_backward(wide_dy, wide_xhat, _per_channel((sum_dy / count).astype(np.float32)),
                           _per_channel((sum_dy_xhat / count).astype(np.float32)),
                           _per_channel(gamma * inv_std))
    return narrow(dx) if is_bf16(dy) else dx


def ours_forward(x: Any, gamma: Any, beta: Any, running: dict[str, Any]
                 ) -> tuple[Any, Any, Any, Any]:
    """``kernels/batchnorm.py``'s training forward on the device, as the layer runs it:
    ``(y, xhat, inv_std, sums)``, the running statistics updated in place."""
    sums = bn.bn_local_sums(x)
    y, xhat, inv_std = bn.bn_train_forward(x, sums, gamma, beta, running, EPS, MOMENTUM,
                                           guard=False)
    return y, xhat, inv_std, sums


def ours_backward(dy: Any, xhat: Any, gamma: Any, inv_std: Any, count: Any) -> Any:
    """``kernels/batchnorm.py``'s backward on the device: ``dx``."""
    sums = bn.bn_backward_local_sums(dy, xhat)
    return bn.bn_backward_apply(dy, xhat, gamma, inv_std, sums, count)


def _gap(a: Any, b: Any) -> float:
    """Largest absolute difference of two device arrays (read once, outside timing)."""
    return float(np.max(np.abs(widen(to_host(a)) - widen(to_host(b))), initial=0.0))


def rows(cupy: Any, width: int, batch: int, base: int, precisions: list[str], repeats: int,
         timer: Timer) -> list[dict[str, Any]]:
    """One row per stage, precision, pass and route."""
    out = []
    rng = np.random.default_rng(0)
    for precision in precisions:
        dtype = bfloat16() if precision == "bf16" else np.dtype(np.float32)
        for shape in shapes(width, batch, base):
            host = rng.standard_normal(shape, dtype=np.float32) * 2 + 1
            x = cupy.asarray(host.astype(dtype))
            dy = cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
            gamma = cupy.asarray(rng.standard_normal(shape[1], dtype=np.float32))
            beta = cupy.asarray(rng.standard_normal(shape[1], dtype=np.float32))
            count = cupy.asarray(np.float64(np.prod(shape) // shape[1]))  # as bn_count
            item, size = dtype.itemsize, int(np.prod(shape))
            results = {}
            for route, forward, backward in (("ours", ours_forward, ours_backward),
                                             ("cupy", cupy_forward, cupy_backward)):
                running = {"running_mean": cupy.zeros(shape[1], dtype=np.float32),
                           "running_var": cupy.ones(shape[1], dtype=np.float32)}
                y, xhat, inv_std, _ = forward(x, gamma, beta, running)
                dx = backward(dy, xhat, gamma, inv_std, count)
                results[route] = (y, dx, running["running_var"].copy())  # before timing
                for name, run, moved in (
                        ("forward", partial(forward, x, gamma, beta, running),
                         4 * size * item),
                        ("backward", partial(backward, dy, xhat, gamma, inv_std, count),
                         5 * size * item)):
                    ms = timer(cupy, run, repeats)
                    out.append({"shape": list(shape), "precision": precision, "pass": name,
                                "route": route, "ms": ms, "bytes": moved,
                                "gb_per_s": moved / ms / 1e6 if ms > 0 else 0.0})
            gaps = [_gap(a, b) for a, b in zip(results["ours"], results["cupy"])]
            for row in out[-4:]:  # the forward's: y's, and the first running variance's
                row["max_gap"] = max(gaps[0], gaps[2]) if row["pass"] == "forward" else gaps[1]
    return out


def pairs(table: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """``(ours, cupy)`` rows of the same shape, precision and pass."""
    def key(row: dict) -> tuple:
        return tuple(row["shape"]), row["precision"], row["pass"]
    theirs = {key(row): row for row in table if row["route"] == "cupy"}
    return [(row, theirs[key(row)]) for row in table if row["route"] == "ours"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--base", type=int, default=16, help="the ResNet's first channels")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from bench_gpu import gpu_median_ms  # this folder: the CUDA-event timer
    from bench_raw_kernels import require_device, write_rows  # cupy with a device, or exit 2

    cupy = require_device("bench_batchnorm")
    table = rows(cupy, args.width, args.batch, args.base, args.precisions, args.repeats,
                 lambda xp, run, repeats: gpu_median_ms(xp, run, repeats, warmup=1))
    print("| shape | precision | pass | ours ms | cupy ms | speed-up | ours GB/s | gap |\n"
          "|---|---|---|---|---|---|---|---|")
    for ours, theirs in pairs(table):
        print(f"| {'x'.join(map(str, ours['shape']))} | {ours['precision']} | {ours['pass']} "
              f"| {ours['ms']:.3f} | {theirs['ms']:.3f} | {theirs['ms'] / ours['ms']:.2f}x "
              f"| {ours['gb_per_s']:.0f} | {ours['max_gap']:.2g} |")
    write_rows(args.out, cupy, args.width, args.batch, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
