"""The machine's sgemm rate: float32 ``numpy.matmul`` of square matrices (the rate that
docs/PERFORMANCE.md measures the convolution kernels against), with PyTorch's beside it.

    python benchmarks/sgemm_rate.py [--size 4096] [--repeat 7] [--threads 1 2]

Each figure is the median GFLOP/s of ``--repeat`` products (after one warm-up), the
numpy and PyTorch products interleaved; ``--threads`` sets OpenBLAS's (and PyTorch's)
thread count for each row.
"""

from __future__ import annotations

import argparse
import statistics
import time

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.kernels.cpu import workers

try:
    import torch
except ImportError:  # numpy only
    torch = None


def rates(size: int, repeat: int, threads: int) -> dict:
    workers.set_blas_threads(threads)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    c = np.empty_like(a)
    fns = {"numpy": lambda: np.matmul(a, b, out=c)}
    if torch is not None:
        torch.set_num_threads(threads)
        ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c.copy())
        fns["torch"] = lambda: torch.mm(ta, tb, out=tc)
    times: dict = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 2.0 * size ** 3 / statistics.median(t) / 1e9 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(f"sgemm {args.size}^2, median of {args.repeat}, {time.strftime('%Y-%m-%d %H:%M')}")
    for threads in args.threads:
        found = rates(args.size, args.repeat, threads)
        print(f"{threads} thread(s): " + ", ".join(f"{k} {v:.0f} GFLOP/s"
                                                  for k, v in found.items()))


if __name__ == "__main__":
    main()
