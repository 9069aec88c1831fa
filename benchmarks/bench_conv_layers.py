"""Per-layer timings of the CPU kernels of CosmoFlow's networks against PyTorch.

``--model cosmoflow`` (default): forward, data gradient (dgrad) and filter gradient
(wgrad) of each convolution of the paper network (k3 p1, no bias; W=128: 4->16 on 128^3,
16->32 on 64^3, 32->64 on 32^3, 64->128 stride 2 on 16^3, 128->256 on 4^3) and its k3 s2
p1 average pools.  ``--model cosmoflow-mlperf``: every layer of the MLPerf network's five
blocks (conv k3 p1 with bias, 32..512 filters -> LeakyReLU(0.3) -> max-pool 2), each
kernel as the training step calls it: conv forward with its bias add, dgrad, wgrad with
the bias gradient, LeakyReLU (in place here and after the pool, out of place in PyTorch
and before it, as in its ``nn.LeakyReLU`` and the reference's order) and max pooling with its argmax, forward and backward.  PyTorch, when
installed, runs the same calls in the same process with the same thread count (its conv
backward through ``aten.convolution_backward``, what autograd calls).  Both allocate
their outputs on every call.

Rounds interleave every kernel of a layer, ours and PyTorch's; ``--stat best`` (default)
shows the best round, ``--stat median`` the median.  On Linux each run starts at a quiet
moment and is repeated when another process used the CPU meanwhile (``/proc/stat``; the
reference box is shared); ``--any-load`` turns that off.  ``--reuse-freed-memory``: see
``cosmotrain/device/heap.py`` (the outputs allocated on every call then reuse mapped pages).

    python benchmarks/bench_conv_layers.py [--model cosmoflow] [--width 128] [--batch 1]
        [--repeat 5] [--stat best|median] [--any-load] [--reuse-freed-memory]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.device.heap import reuse_freed_memory
from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import choice as compiled_choice
from cosmotrain.kernels.activation import leaky_relu_backward, leaky_relu_forward
from cosmotrain.kernels.conv3d import (conv3d_backward_data, conv3d_backward_filter,
                                       conv3d_forward)
from cosmotrain.kernels.pool3d import (avg_pool3d_backward, avg_pool3d_forward,
                                       max_pool3d_backward, max_pool3d_forward)
from cosmotrain.kernels.cpu.channel_sums import channel_sums

try:
    import torch
except ImportError:  # the torch columns are left out
    torch = None

# name, in channels, out channels, input size as a fraction of W, stride
CONVS = {"cosmoflow": [("conv1", 4, 16, 1, 1), ("conv2", 16, 32, 2, 1), ("conv3", 32, 64, 4, 1),
                       ("conv4", 64, 128, 8, 2), ("conv5", 128, 256, 32, 1)],
         "cosmoflow-mlperf": [("conv1", 4, 32, 1, 1), ("conv2", 32, 64, 2, 1),
                              ("conv3", 64, 128, 4, 1), ("conv4", 128, 256, 8, 1),
                              ("conv5", 256, 512, 16, 1)]}
# name, channels, input size as a fraction of W (the pool after each conv)
POOLS = [("pool1", 16, 1), ("pool2", 32, 2), ("pool3", 64, 4), ("pool4", 128, 16),
         ("pool5", 256, 32)]
MLPERF_SLOPE = 0.3

Fns = Dict[str, Callable[[], object]]


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


def timings(fns: Dict, repeat: int, exclusive: bool) -> Dict[object, List[float]]:
    """Wall times of each function over ``repeat`` rounds, the functions interleaved.

    With ``exclusive`` a run during which other processes used the CPU is repeated after a
    quiet moment (up to 3 times; the fastest attempt is kept either way).
    """
    for fn in fns.values():
        fn()  # warm-up: thread pools, scratch buffers
    times: Dict[object, List[float]] = {name: [] for name in fns}
    ticks = os.sysconf("SC_CLK_TCK") if _OtherLoad.enabled else 0
    for _ in range(repeat):
        for name, fn in fns.items():
            best = float("inf")
            for _attempt in range(4 if exclusive else 1):
                if exclusive:
                    _OtherLoad.wait_quiet()
                    fn()  # re-warm threads and clocks after the wait
                with _OtherLoad() as load:
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                if load.used <= 1 + 0.05 * best * ticks:
                    break
            times[name].append(best)
    return times


def conv_cases(c: int, f: int, size: int, stride: int, batch: int, bias: bool, rng):
    x = rng.standard_normal((batch, c, size, size, size), dtype=np.float32)
    w = rng.standard_normal((f, c, 3, 3, 3), dtype=np.float32) * 0.1
    b = rng.standard_normal(f, dtype=np.float32) if bias else None
    y = conv3d_forward(x, w, stride, 1)
    dy = rng.standard_normal(y.shape, dtype=np.float32)

    def fwd():
        out = conv3d_forward(x, w, stride, 1)
        if b is not None:
            out += b.reshape(1, -1, 1, 1, 1)
        return out

    def wgrad():
        return conv3d_backward_filter(x, dy, w.shape, stride, 1), b is None or channel_sums(dy)

    ours = {"fwd": fwd, "dgrad": lambda: conv3d_backward_data(dy, w, x.shape, stride, 1),
            "wgrad": wgrad}
    theirs = {}
    if torch is not None:
        xt, wt, dyt = (torch.from_numpy(a) for a in (x, w, dy))
        bt = None if b is None else torch.from_numpy(b)
        back = torch.ops.aten.convolution_backward
        sizes, st = ([f] if bias else None), [stride] * 3
        theirs = {"fwd": lambda: torch.nn.functional.conv3d(xt, wt, bt, stride=stride, padding=1),
                  "dgrad": lambda: back(dyt, xt, wt, sizes, st, [1] * 3, [1] * 3, False,
                                        [0] * 3, 1, [True, False, False]),
                  "wgrad": lambda: back(dyt, xt, wt, sizes, st, [1] * 3, [1] * 3, False,
                                        [0] * 3, 1, [False, True, bias])}
    flops = 2.0 * f * c * 27 * y[0, 0].size * batch
    return ours, theirs, flops


def avg_pool_cases(c: int, size: int, batch: int, rng):
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


def act_pool_cases(c: int, size: int, batch: int, rng) -> Tuple[Fns, Fns, Fns, Fns]:
    """LeakyReLU and 2x2x2 max pooling after an MLPerf convolution: (ours, theirs) twice.

    Our LeakyReLU runs after the pool, on its output (1/8 of the elements), as
    cosmotrain's network does (``models/mlperf.py``: the same function); PyTorch's runs
    before it, on the convolution's output, as the MLPerf reference and its users write
    the block.
    """
    y = rng.standard_normal((batch, c, size, size, size), dtype=np.float32)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    _, arg = max_pool3d_forward(y, 2)
    dyp = rng.standard_normal(arg.shape, dtype=np.float32)
    yp, dyp_act = (rng.standard_normal(arg.shape, dtype=np.float32) for _ in range(2))
    # In place on fixed buffers (as the layers run): a few rounds shrink the negatives by
    # 0.3 each, far from float32's subnormals.
    act = {"fwd": lambda: leaky_relu_forward(yp, MLPERF_SLOPE),
           "bwd": lambda: leaky_relu_backward(dyp_act, yp, MLPERF_SLOPE)}
    pool = {"fwd": lambda: max_pool3d_forward(y, 2),
            "bwd": lambda: max_pool3d_backward(dyp, arg, y.shape, 2)}
    if torch is None:
        return act, {}, pool, {}
    yt, dyt, dypt = torch.from_numpy(y), torch.from_numpy(dy), torch.from_numpy(dyp)
    k, z, one = [2, 2, 2], [0, 0, 0], [1, 1, 1]
    _, index = torch.ops.aten.max_pool3d_with_indices(yt, k, k, z, one, False)
    act_t = {"fwd": lambda: torch.nn.functional.leaky_relu(yt, MLPERF_SLOPE),
             "bwd": lambda: torch.ops.aten.leaky_relu_backward(dyt, yt, MLPERF_SLOPE, False)}
    pool_t = {"fwd": lambda: torch.ops.aten.max_pool3d_with_indices(yt, k, k, z, one, False),
              "bwd": lambda: torch.ops.aten.max_pool3d_with_indices_backward(
                  dypt, yt, k, k, z, one, False, index)}
    return act, act_t, pool, pool_t


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
            f"{np.__version__} ({blas}), kernel workers {workers.num_workers()}")
    if torch is not None:
        text += f"; torch {torch.__version__}, {threads} threads"
    else:
        text += "; torch not installed (no comparison columns)"
    return text


class Table:
    """Rows ``| layer kernel | ours ms | GF/s | torch ms | GF/s | torch / ours |`` + totals."""

    def __init__(self, stat: str) -> None:
        self.pick = min if stat == "best" else statistics.median
        self.total = {"ours": 0.0, "torch": 0.0, "flops": 0.0}
        cols = "| kernel | ours ms | GF/s |" + (" torch ms | GF/s | torch / ours |"
                                                 if torch is not None else "")
        print(cols)
        print("|" + "---|" * (cols.count("|") - 1))

    def add(self, name: str, ours: Fns, theirs: Fns, flops: Optional[float],
            repeat: int, exclusive: bool) -> None:
        fns = {("ours", k): fn for k, fn in ours.items()}
        fns.update({("torch", k): fn for k, fn in theirs.items()})
        times = timings(fns, repeat, exclusive)
        for kind in ours:
            mine = self.pick(times[("ours", kind)])
            text = f"| {name} {kind} | {mine * 1e3:.1f} | " + self._rate(flops, mine)
            self.total["ours"] += mine
            self.total["flops"] += flops or 0.0
            if ("torch", kind) in times:
                other = self.pick(times[("torch", kind)])
                self.total["torch"] += other
                text += f" {other * 1e3:.1f} | {self._rate(flops, other)} {other / mine:.2f} |"
            print(text, flush=True)

    @staticmethod
    def _rate(flops: Optional[float], seconds: float) -> str:
        return f"{flops / seconds / 1e9:.0f} |" if flops else "|"

    def finish(self) -> None:
        t, f = self.total, self.total["flops"]
        text = f"| all | {t['ours'] * 1e3:.0f} | {f / t['ours'] / 1e9:.0f} |"
        if torch is not None:
            text += (f" {t['torch'] * 1e3:.0f} | {f / t['torch'] / 1e9:.0f} |"
                     f" {t['torch'] / t['ours']:.2f} |")
        print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONVS), default="cosmoflow")
    parser.add_argument("--width", type=int, default=128, help="input width W (default 128)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds")
    parser.add_argument("--stat", choices=("best", "median"), default="best",
                        help="which round to show (default: the best)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads of both sides: PyTorch's, and cosmotrain's BLAS "
                        "threads and kernel workers (default: all CPUs)")
    parser.add_argument("--any-load", action="store_true",
                        help="keep rounds during which other processes used the CPU")
    parser.add_argument("--reuse-freed-memory", action="store_true",
                        help="keep freed memory in glibc's heap (cosmotrain/device/heap.py)")
    parser.add_argument("--no-direct", action="store_true",
                        help="GEMM lowerings only: no compiled direct convolution loops "
                        "(cosmotrain/kernels/compiled/direct.py), for A/B runs")
    args = parser.parse_args()
    compiled_choice.USE_DIRECT = not args.no_direct
    if args.reuse_freed_memory and not reuse_freed_memory():
        print("glibc heap reuse not available")
    workers.configure_threads(workers.KernelThreads(args.threads))
    if torch is not None:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    mlperf = args.model == "cosmoflow-mlperf"
    print(describe_machine(args.threads))
    print(f"{args.model} W={args.width}, batch {args.batch}, {args.stat} of {args.repeat}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    table, run = Table(args.stat), dict(repeat=args.repeat, exclusive=not args.any_load)
    for name, c, f, frac, stride in CONVS[args.model]:
        size = args.width // frac
        ours, theirs, flops = conv_cases(c, f, size, stride, args.batch, mlperf, rng)
        if mlperf and name == "conv1":  # the network's first layer needs no input gradient
            ours.pop("dgrad")
            theirs.pop("dgrad", None)
        table.add(name, ours, theirs, flops, **run)
        if mlperf:
            act, act_t, pool, pool_t = act_pool_cases(f, size, args.batch, rng)
            table.add(f"pool{name[-1]}", pool, pool_t, None, **run)
            table.add(f"act{name[-1]}", act, act_t, None, **run)
    if not mlperf:
        for name, c, frac in POOLS:
            table.add(name, *avg_pool_cases(c, args.width // frac, args.batch, rng), None, **run)
    table.finish()


if __name__ == "__main__":
    main()
