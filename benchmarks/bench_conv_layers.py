"""Per-layer timings of the CPU conv3d and avg-pool kernels on the CosmoFlow network.

Times forward, data gradient (dgrad) and filter gradient (wgrad) of each convolution of
the default ``cosmoflow`` model (k3 p1, no bias; W=128: 4->16 on 128^3, 16->32 on 64^3,
32->64 on 32^3, 64->128 stride 2 on 16^3, 128->256 on 4^3) and its k3 s2 p1 average
pools, for cosmotrain and, when installed, PyTorch in the same process with the same
thread count.  Both allocate their outputs on every call.  Each figure is the best of
``--repeat`` interleaved rounds.  On Linux each run starts at a quiet moment and is
repeated when another process used the CPU meanwhile (``/proc/stat``; the reference box
is shared); ``--any-load`` turns that off.

    python benchmarks/bench_conv_layers.py [--width 128] [--batch 1] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from cosmotrain.kernels import _parallel
from cosmotrain.kernels.conv3d import (conv3d_backward_data, conv3d_backward_filter,
                                       conv3d_forward)
from cosmotrain.kernels.pool3d import avg_pool3d_backward, avg_pool3d_forward

try:
    import torch
except ImportError:  # the torch columns are left out
    torch = None

# name, in channels, out channels, input size as a fraction of W, stride
CONVS = [("conv1", 4, 16, 1, 1), ("conv2", 16, 32, 2, 1), ("conv3", 32, 64, 4, 1),
         ("conv4", 64, 128, 8, 2), ("conv5", 128, 256, 32, 1)]
# name, channels, input size as a fraction of W (the pool after each conv)
POOLS = [("pool1", 16, 1), ("pool2", 32, 2), ("pool3", 64, 4), ("pool4", 128, 16),
         ("pool5", 256, 32)]


class _OtherLoad:
    """CPU time (clock ticks) used by other processes, from /proc/stat (Linux only)."""

    enabled = os.path.exists("/proc/stat")

    @staticmethod
    def _others() -> float:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        mine = sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK")
        return sum(ticks) - ticks[3] - ticks[4] - mine  # busy minus idle, iowait and us

    def __enter__(self) -> "_OtherLoad":
        self.start = self._others() if self.enabled else 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.used = self._others() - self.start if self.enabled else 0.0

    @classmethod
    def wait_quiet(cls, limit_s: float = 60.0) -> None:
        deadline = time.time() + limit_s
        while cls.enabled and time.time() < deadline:
            with cls() as load:
                time.sleep(0.2)
            if load.used < 2:
                return


def best_of(fns: Dict[str, Callable[[], object]], repeat: int,
            exclusive: bool) -> Dict[str, float]:
    """Best wall time of each function, the functions interleaved round by round.

    With ``exclusive`` a run during which other processes used the CPU is repeated after a
    quiet moment (up to 3 times; the best run is kept either way).
    """
    for fn in fns.values():
        fn()  # warm-up: thread pools, scratch buffers
    best = {name: float("inf") for name in fns}
    ticks = os.sysconf("SC_CLK_TCK") if _OtherLoad.enabled else 0
    for _ in range(repeat):
        for name, fn in fns.items():
            for _attempt in range(4 if exclusive else 1):
                if exclusive:
                    _OtherLoad.wait_quiet()
                    fn()  # re-warm threads and clocks after the wait
                with _OtherLoad() as load:
                    t0 = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - t0
                best[name] = min(best[name], elapsed)
                if load.used <= 1 + 0.05 * elapsed * ticks:
                    break
    return best


def conv_cases(c: int, f: int, size: int, stride: int, batch: int, rng):
    x = rng.standard_normal((batch, c, size, size, size), dtype=np.float32)
    w = rng.standard_normal((f, c, 3, 3, 3), dtype=np.float32) * 0.1
    y = conv3d_forward(x, w, stride, 1)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    ours = {"fwd": lambda: conv3d_forward(x, w, stride, 1),
            "dgrad": lambda: conv3d_backward_data(dy, w, x.shape, stride, 1),
            "wgrad": lambda: conv3d_backward_filter(x, dy, w.shape, stride, 1)}
    theirs = {}
    if torch is not None:
        xt, wt, dyt = (torch.from_numpy(a) for a in (x, w, dy))
        theirs = {"fwd": lambda: torch.nn.functional.conv3d(xt, wt, stride=stride, padding=1),
                  "dgrad": lambda: torch.nn.grad.conv3d_input(xt.shape, wt, dyt, stride, 1),
                  "wgrad": lambda: torch.nn.grad.conv3d_weight(xt, wt.shape, dyt, stride, 1)}
    flops = 2.0 * f * c * 27 * y[0, 0].size * batch
    return ours, theirs, flops


def pool_cases(c: int, size: int, batch: int, rng):
    x = rng.standard_normal((batch, c, size, size, size), dtype=np.float32)
    y = avg_pool3d_forward(x, 3, 2, 1)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    ours = {"fwd": lambda: avg_pool3d_forward(x, 3, 2, 1),
            "bwd": lambda: avg_pool3d_backward(dy, x.shape, 3, 2, 1)}
    theirs = {}
    if torch is not None:
        xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)
        theirs = {"fwd": lambda: torch.nn.functional.avg_pool3d(xt, 3, 2, 1),
                  "bwd": lambda: torch.ops.aten.avg_pool3d_backward(
                      dyt, xt, [3, 3, 3], [2, 2, 2], [1, 1, 1], False, True, None)}
    return ours, theirs


def row(name: str, ours: float, theirs: Optional[float], flops: Optional[float]) -> str:
    text = f"{name:14} {ours * 1e3:9.1f}"
    if flops:
        text += f" {flops / ours / 1e9:7.0f}"
    if theirs is not None:
        text += f" {theirs * 1e3:9.1f}" + (f" {flops / theirs / 1e9:7.0f}" if flops else "")
        text += f" {theirs / ours:7.2f}x"
    return text


def header(flops: bool) -> str:
    cols = f"{'':14} {'ours ms':>9}" + (f" {'GF/s':>7}" if flops else "")
    if torch is not None:
        cols += f" {'torch ms':>9}" + (f" {'GF/s':>7}" if flops else "") + f" {'speedup':>8}"
    return cols


def describe_machine(threads: int) -> str:
    blas = "unknown BLAS"
    try:
        import ctypes
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "openblas" in line.lower())
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_corename64_", "openblas_get_corename64_",
                     "openblas_get_corename"):
            if hasattr(lib, name):
                getattr(lib, name).restype = ctypes.c_char_p
                blas = f"OpenBLAS core {getattr(lib, name)().decode()}"
                break
    except (OSError, StopIteration):
        pass
    text = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, numpy "
            f"{np.__version__} ({blas}), kernel workers {_parallel.num_workers()}")
    if torch is not None:
        text += f"; torch {torch.__version__}, {threads} threads"
    else:
        text += "; torch not installed (no comparison columns)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=128, help="input width W (default 128)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (best is shown)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: all CPUs)")
    parser.add_argument("--any-load", action="store_true",
                        help="keep rounds during which other processes used the CPU")
    args = parser.parse_args()
    if torch is not None:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(describe_machine(args.threads))
    print(f"CosmoFlow W={args.width}, batch {args.batch}, best of {args.repeat}\n")
    print(header(flops=True))
    totals: Dict[str, List[float]] = {"ours": [], "torch": [], "flops": []}
    for name, c, f, frac, stride in CONVS:
        ours, theirs, flops = conv_cases(c, f, args.width // frac, stride, args.batch, rng)
        fns = {("ours", k): fn for k, fn in ours.items()}
        fns.update({("torch", k): fn for k, fn in theirs.items()})
        best = best_of(fns, args.repeat, not args.any_load)
        for kind in ours:
            t_theirs = best.get(("torch", kind))
            print(row(f"{name} {kind}", best[("ours", kind)], t_theirs, flops))
            totals["ours"].append(best[("ours", kind)])
            totals["flops"].append(flops)
            if t_theirs is not None:
                totals["torch"].append(t_theirs)
    total_theirs = sum(totals["torch"]) if totals["torch"] else None
    print(row("all convs", sum(totals["ours"]), total_theirs, sum(totals["flops"])))
    print()
    print(header(flops=False))
    pool_ours: List[float] = []
    pool_theirs: List[float] = []
    for name, c, frac in POOLS:
        ours, theirs = pool_cases(c, args.width // frac, args.batch, rng)
        fns = {("ours", k): fn for k, fn in ours.items()}
        fns.update({("torch", k): fn for k, fn in theirs.items()})
        best = best_of(fns, args.repeat, not args.any_load)
        for kind in ours:
            t_theirs = best.get(("torch", kind))
            print(row(f"{name} {kind}", best[("ours", kind)], t_theirs, None))
            pool_ours.append(best[("ours", kind)])
            if t_theirs is not None:
                pool_theirs.append(t_theirs)
    print(row("all pools", sum(pool_ours), sum(pool_theirs) if pool_theirs else None, None))


if __name__ == "__main__":
    main()
