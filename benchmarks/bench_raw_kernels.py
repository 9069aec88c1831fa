"""Our own CUDA kernels (cosmotrain/kernels/cuda/src/*.cu) on one GPU: time and bandwidth.

    python benchmarks/bench_raw_kernels.py [--width 128] [--batch 8]
        [--precisions fp32 bf16] [--repeats 20] [--out results.json]

What is timed: each kernel of ``kernels/cuda/raw_ops.py`` on the paper network's largest
tensors at width W (the first pooling's 16 x W^3 input per sample; MLPerf's first max
pooling's 32 x W^3; the int16 input batch, 4 x W^3, channels last; Adam over the paper
network's 9.4 M parameters in 16 flat tensors), the median of ``--repeats`` launches
timed by CUDA events after one warm-up launch (which compiles the module).  Beside each:
the bytes it must read and write (compulsory, from the shapes) and the bandwidth that
makes, against the device's peak (H200: about 4.8 TB/s): a kernel far below it is
bound by something else (index arithmetic, launches) and is where to work next.

Prints a markdown table; ``--out`` writes it as JSON.  Needs cupy and a CUDA device
(exit code 2 with a message otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.data.readers.transform import int16_log1p_table
from cosmotrain.kernels import pool3d
from cosmotrain.kernels.cuda import raw_ops

from bench_gpu import gpu_median_ms  # this folder: the CUDA-event timer
from cosmotrain.precision import bfloat16


def require_device(script: str = "bench_raw_kernels") -> Any:
    """cupy with a usable device, or exit 2 saying why not (as ``script``)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
        reason = "no CUDA device"
    except Exception as error:  # noqa: BLE001 - no cupy, no driver: the same answer
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    print(f"{script}: needs cupy and a CUDA device ({reason})", file=sys.stderr)
    sys.exit(2)


def write_rows(out: Any, cupy: Any, width: int, batch: int, rows: list) -> None:
    """The rows as JSON in ``out`` (nothing when None), with the sizes and the device."""
    if not out:
        return
    with open(out, "w") as file:
        json.dump({"width": width, "batch": batch, "rows": rows,
                   "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()},
                  file, indent=1)


def cases(cupy: Any, width: int, batch: int, dtype: Any) -> list[tuple[str, Callable, int]]:
    """``(name, launch, compulsory bytes)`` of every timed kernel."""
    item = np.dtype(dtype).itemsize
    rng = cupy.random.default_rng(0)
    act = rng.standard_normal((batch, 16, width, width, width), dtype=np.float32).astype(dtype)
    pool = pool3d.PoolGeometry(act.shape, 3, 2, 1)
    dy = rng.standard_normal(pool.y_shape, dtype=np.float32).astype(dtype)
    wide = rng.standard_normal((batch, 32, width, width, width), dtype=np.float32).astype(dtype)
    y_max, arg = raw_ops.max_pool2_forward(wide)
    dy_max = cupy.ones_like(y_max)
    counts = cupy.asarray(np.random.default_rng(1).integers(
        0, 50, size=(batch, width, width, width, 4), dtype=np.int16))
    table = cupy.asarray(int16_log1p_table())
    bias = cupy.zeros(16, dtype=np.float32)
    total, flag, skip = cupy.zeros(1), cupy.zeros(1, dtype=np.int32), cupy.zeros(1, np.int32)
    target = cupy.zeros(act.shape, dtype=np.float32)
    sizes = [588_000] * 16  # about the paper network's 9.4 M parameters
    roles = [[cupy.ones(n, dtype=np.float32) for n in sizes] for _ in range(4)]
    adam = raw_ops.tensor_table(roles, lambda a: a.data.ptr, cupy)
    hyper = cupy.asarray(raw_ops.adam_hyper(0.9, 0.999, 1e-8, 1e-3, 1))
    a, y, w, params = act.size * item, dy.size * item, wide.size * item, sum(sizes) * 4
    return [
        ("input int16 -> log1p", lambda: raw_ops.input_transform(counts, dtype, "log1p", True,
                                                                 table), counts.size * (2 + item)),
        ("bias + LeakyReLU (in place)", lambda: raw_ops.bias_leaky_relu(act, bias, 0.3, out=act),
         2 * a),
        ("avg pool k3s2p1 forward", lambda: raw_ops.avg_pool_forward(act, pool), a + y),
        ("avg pool backward + LeakyReLU", lambda: raw_ops.avg_pool_backward(dy, pool, act, 0.3),
         y + 2 * a),
        ("max pool 2 forward", lambda: raw_ops.max_pool2_forward(wide),
         w + w // 8 + w // (8 * item)),
        ("max pool 2 backward", lambda: raw_ops.max_pool2_backward(dy_max, arg, wide.shape),
         w + w // 8 + w // (8 * item)),
        ("dropout", lambda: raw_ops.dropout(act, (0,) * 5, act.shape, 0.2, 12345), 2 * a),
        ("MSE + gradient + flag", lambda: raw_ops.mse(act, target, act.size, total, flag),
         2 * a + act.size * 4),
        ("Adam, 16 tensors, one launch", lambda: raw_ops.multi_update("adam_multi", adam, hyper,
                                                                       skip), 7 * params),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--peak-gbs", type=float, default=4800.0,
                        help="the device's memory bandwidth, GB/s (H200: 4800)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cupy = require_device()
    rows = []
    print("| kernel | precision | ms | MB moved | GB/s | of peak |\n|---|---|---|---|---|---|")
    for precision in args.precisions:
        dtype = bfloat16() if precision == "bf16" else np.dtype(np.float32)
        for name, run, moved in cases(cupy, args.width, args.batch, dtype):
            ms = gpu_median_ms(cupy, run, args.repeats, warmup=1)  # warm-up: compiles
            rate = moved / ms / 1e6
            rows.append({"kernel": name, "precision": precision, "ms": ms, "bytes": moved,
                         "gb_per_s": rate, "of_peak": rate / args.peak_gbs})
            print(f"| {name} | {precision} | {ms:.3f} | {moved / 1e6:.0f} | {rate:.0f} | "
                  f"{rate / args.peak_gbs:.0%} |")
    write_rows(args.out, cupy, args.width, args.batch, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
