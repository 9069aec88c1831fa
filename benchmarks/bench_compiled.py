"""Compiled convolution loops against the GEMM lowerings, per CosmoFlow layer.

For each stride-1 3x3x3 layer of ``cosmoflow`` and ``cosmoflow-mlperf`` (W=128, one
sample by default) this times the three algorithms that ``cosmotrain.kernels`` can run,
on the same data, in the same process, each call best of ``--repeat``:

* ``lowered``: the numpy GEMM lowerings (``compiled_choice.USE_DIRECT = False``);
* ``direct``: the compiled direct loops (``kernels/compiled/direct.py``), where the row width
  fits their register runs;
* ``winograd``: F(4,3) or F(2,3) along W (``kernels/compiled/winograd.py``; the tile
  ``compiled_choice`` picks; the filter gradient's form is F(2,3));

for the forward, the data gradient (the forward of the flipped kernel) and the filter
gradient, and marks ``*`` the one ``compiled_choice`` picks.  Each compiled result is
checked against the lowering's (max relative difference printed) before timing.  Rates
are the direct convolution's flops over the time (Winograd's are "effective").

    python benchmarks/bench_compiled.py [--threads 1] [--batch 1] [--repeat 3]
        [--layers "ml conv2" ...]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, Optional

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.compiled import choice as compiled_choice, direct, winograd
from cosmotrain.kernels import conv3d
from cosmotrain.kernels.geometry import ConvGeometry

from bench_conv_layout import best_of  # this folder: the best-of-n timer

LAYERS = [("cf conv1", 4, 16, 128), ("cf conv2", 16, 32, 64), ("cf conv3", 32, 64, 32),
          ("ml conv1", 4, 32, 128), ("ml conv2", 32, 64, 64), ("ml conv3", 64, 128, 32),
          ("ml conv4", 128, 256, 16), ("ml conv5", 256, 512, 8)]


def lowered(fn: Callable[[], np.ndarray]) -> np.ndarray:
    compiled_choice.USE_DIRECT = False
    try:
        return fn()
    finally:
        compiled_choice.USE_DIRECT = True


def candidates(x, w, dy, geo, tgeo, flipped) -> Dict[str, Dict[str, Optional[Callable]]]:
    """Per pass, per algorithm: a call computing it, or None where it does not apply."""
    dx = np.empty(x.shape, np.float32)
    y = np.empty(geo.y_shape, np.float32)
    fits = geo.out[2] >= direct.register_run()
    return {
        "forward": {
            "lowered": lambda: lowered(lambda: conv3d.conv3d_forward(x, w, 1, 1, out=y)),
            "direct": (lambda: direct.forward(x, w, geo, y)) if fits else None,
            "winograd": lambda: winograd.forward(x, w, geo, y, None,
                                                 compiled_choice.winograd_tile(geo))},
        "data grad": {
            "lowered": lambda: lowered(
                lambda: conv3d.conv3d_backward_data(dy, w, x.shape, 1, 1, out=dx)),
            "direct": (lambda: direct.forward(dy, flipped, tgeo, dx)) if fits else None,
            "winograd": lambda: winograd.forward(dy, flipped, tgeo, dx, None,
                                                 compiled_choice.winograd_tile(tgeo))},
        "filter grad": {
            "lowered": lambda: lowered(
                lambda: conv3d.conv3d_backward_filter(x, dy, w.shape, 1, 1)),
            "direct": (lambda: direct.filter_grad(x, dy, geo)) if fits else None,
            "winograd": lambda: winograd.filter_grad(x, dy, geo,
                                                     compiled_choice.winograd_tile(geo))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layers", nargs="+", default=[name for name, *_ in LAYERS])
    args = parser.parse_args()
    if not direct.available():
        raise SystemExit("bench_compiled: the compiled loops were not built (see README)")
    workers.configure_threads(workers.KernelThreads(args.threads))
    rng = np.random.default_rng(0)
    print(f"# {direct.describe()}, {args.threads} thread(s), batch {args.batch}, best of "
          f"{args.repeat}, {time.strftime('%Y-%m-%d %H:%M')}; ms (GFLOP/s), * = chosen\n")
    print("| layer | pass | lowered | direct | winograd | max rel. diff |")
    print("|---|---|---|---|---|---|")
    for name, c, f, size in LAYERS:
        if name not in args.layers:
            continue
        x = rng.standard_normal((args.batch, c) + (size,) * 3, dtype=np.float32)
        w = (rng.standard_normal((f, c, 3, 3, 3)) * 0.1).astype(np.float32)
        geo = ConvGeometry.create(x.shape, w.shape, 1, 1)
        dy = rng.standard_normal(geo.y_shape, dtype=np.float32)
        flipped = w[:, :, ::-1, ::-1, ::-1].transpose(1, 0, 2, 3, 4)
        tgeo = ConvGeometry.create(dy.shape, flipped.shape, 1, 1)
        gflop = 2 * args.batch * c * f * 27 * size ** 3 / 1e9
        f32 = np.float32
        picks = {"forward": compiled_choice.forward_kernel(geo, f32),
                 "data grad": compiled_choice.data_grad_kernel(tgeo, c, f32),
                 "filter grad": compiled_choice.filter_grad_kernel(geo, f32)}
        for step, calls in candidates(x, w, dy, geo, tgeo, flipped).items():
            reference = np.array(calls["lowered"](), copy=True)
            cells, worst = [], 0.0
            for algorithm, call in calls.items():
                if call is None:
                    cells.append("-")
                    continue
                result = call()
                worst = max(worst, float(np.abs(result - reference).max()
                                         / np.abs(reference).max()))
                ms = best_of(call, args.repeat) * 1e3
                mark = "*" if picks[step] == algorithm else ""
                cells.append(f"{ms:.1f} ({gflop / ms * 1e3:.0f}){mark}")
            print(f"| {name} {c}->{f} {size}^3 | {step} | " + " | ".join(cells)
                  + f" | {worst:.1e} |", flush=True)


if __name__ == "__main__":
    main()
