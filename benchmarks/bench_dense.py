"""The dense head on our own CUDA kernels against cuBLAS, on one GPU (issue 35 item 4).

    python benchmarks/bench_dense.py [--width 128] [--batch 1 8 32]
        [--precisions fp32 bf16] [--repeats 20] [--out results.json] [--dry-run]

What is timed: each linear layer of both networks' heads at width W (the paper
network's fc1 8*256 -> 2048, fc2 2048 -> 256, fc3 256 -> 4 at W = 128; MLPerf's fc1
32,768 -> 128, fc2 128 -> 64, fc3 64 -> 4), each pass (forward with the bias, data
gradient, weight and bias gradient), through the front doors of
``cosmotrain/kernels/linear.py`` under ``ConvSettings(dense="kernels")`` (ours,
``kernels/cuda/src/linear.cu``, through the faces it calls) and under the default
``dense="cublas"`` (cupy's matmul: in bf16 with today's widening and narrowing passes
around it).  The median
of ``--repeats`` calls timed by CUDA events after one warm-up call (which compiles the
module).  Beside each pair: the ratio, and the largest difference between the two
results relative to the largest magnitude (float32 summation order; bf16 one rounding),
read after the timing.

Why: a CUDA graph cannot capture cuBLAS, so the captured step needs ours; this says
what they cost against cuBLAS (eager) before ``dense: kernels`` is made the default.

``--dry-run`` runs every line but the device's on the CPU: numpy operands, our kernels
through the host build of their source (tests/cuda_host.py), cuBLAS replaced by the
CPU's BLAS, wall-clock times (meaningless as figures; small widths: ``--width 16``).

Prints a markdown table; ``--out`` writes it as JSON.  Without ``--dry-run`` it needs
cupy and a CUDA device (exit code 2 with a message otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.kernels import linear
from cosmotrain.kernels.cuda import raw, raw_linear
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.models.cosmoflow import build_cosmoflow
from cosmotrain.models.mlperf import build_mlperf
from cosmotrain.nn.layers import Linear
from cosmotrain.precision import bfloat16, widen

NETWORKS = {"paper": build_cosmoflow, "mlperf": build_mlperf}
SETTINGS = {"cublas": ConvSettings(dense="cublas")}
PASSES = ("forward", "backward data", "backward weight")


def head(network: str, width: int) -> list[tuple[str, int, int]]:
    """``(name, inputs, outputs)`` of each linear layer of ``network`` at ``width``."""
    model = NETWORKS[network](width)
    return [(layer.name, layer.in_features, layer.out_features) for layer in model.items
            if isinstance(layer, Linear)]


def calls(xp: Any, batch: int, inputs: int, outputs: int, dtype: Any
          ) -> dict[str, dict[str, Callable[[], Any]]]:
    """pass -> {"ours", "cublas"} -> call, on operands of one layer (weights as
    ``Parameter.like`` hands them: in the activations' dtype).  Ours: the faces that
    ``kernels/linear.py`` calls under ``dense: kernels`` (what they add is a dtype and
    layout check); cuBLAS: that front door under the default settings."""
    rng = np.random.default_rng(0)

    def array(*shape: int) -> Any:
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    x, w, b, dy = array(batch, inputs), array(outputs, inputs), array(outputs), \
        array(batch, outputs)
    cublas = SETTINGS["cublas"]
    return {
        "forward": {"ours": lambda: raw_linear.forward(x, w, b),
                    "cublas": lambda: linear.linear_forward(x, w, b, settings=cublas)},
        "backward data": {"ours": lambda: raw_linear.backward_data(dy, w),
                          "cublas": lambda: linear.linear_backward_data(dy, w,
                                                                         settings=cublas)},
        "backward weight": {
            "ours": lambda: raw_linear.backward_weight(x, dy)[0],
            "cublas": lambda: linear.linear_backward_weight(x, dy, settings=cublas)[0]}}


def difference(xp: Any, ours: Any, theirs: Any) -> float:
    """max |ours - theirs| / max |theirs| (a host read, outside the timing)."""
    to_host = xp.asnumpy if xp is not np else np.asarray
    a, b = widen(to_host(ours)).astype(np.float64), widen(to_host(theirs)).astype(np.float64)
    scale = float(np.abs(b).max(initial=0.0)) or 1.0
    return float(np.abs(a - b).max(initial=0.0)) / scale


def wall_median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """The dry run's timer: median wall-clock ms (the CPU, no device)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _device() -> tuple[Any, Callable]:
    """cupy and its CUDA-event timer, or exit 2 saying why not."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            from bench_gpu import gpu_median_ms  # this folder: the CUDA-event timer
            return cupy, lambda fn, repeats: gpu_median_ms(cupy, fn, repeats, warmup=1)
        reason = "no CUDA device"
    except Exception as error:  # noqa: BLE001 - no cupy, no driver: the same answer
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    print(f"bench_dense: needs cupy and a CUDA device ({reason}); --dry-run runs on the CPU",
          file=sys.stderr)
    sys.exit(2)


def _host_build() -> None:
    """The dry run: our kernels launched by their host build (tests/cuda_host.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cuda_host import HostLauncher

    raw.cupy_launch = HostLauncher()  # this process only: it exits after the run


def measure(xp: Any, timer: Callable, width: int, batches: list[int], precisions: list[str],
            repeats: int) -> list[dict[str, Any]]:
    rows = []
    for precision in precisions:
        dtype = bfloat16() if precision == "bf16" else np.dtype(np.float32)
        for network in NETWORKS:
            for name, inputs, outputs in head(network, width):
                for batch in batches:
                    for step, pair in calls(xp, batch, inputs, outputs, dtype).items():
                        ms = {kind: timer(fn, repeats) for kind, fn in pair.items()}
                        rows.append({
                            "network": network, "layer": name, "inputs": inputs,
                            "outputs": outputs, "batch": batch, "precision": precision,
                            "pass": step, "ours_ms": ms["ours"], "cublas_ms": ms["cublas"],
                            "ratio": ms["ours"] / ms["cublas"],
                            "difference": difference(xp, pair["ours"](),
                                                     pair["cublas"]())})
                        print("| {network} {layer} ({inputs} -> {outputs}) | {batch} | "
                              "{precision} | {pass} | {ours_ms:.4f} | {cublas_ms:.4f} | "
                              "{ratio:.2f} | {difference:.1e} |".format(**rows[-1]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU: numpy, our kernels' host build, wall-clock times")
    args = parser.parse_args(argv)
    if args.dry_run:
        xp, timer, device = np, wall_median_ms, "cpu (dry run: host build, numpy BLAS)"
        _host_build()
    else:
        xp, timer = _device()
        device = xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print("| layer | batch | precision | pass | ours ms | cuBLAS ms | ours / cuBLAS | "
          "difference |\n|---|---|---|---|---|---|---|---|")
    rows = measure(xp, timer, args.width, args.batch, args.precisions, args.repeats)
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"width": args.width, "device": device, "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
