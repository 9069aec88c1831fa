"""Memory and parallel-efficiency study of hybrid training (drives bench_hybrid.py).

    python benchmarks/hybrid_study.py memory --widths 128 256 --ways 1 2 4 8
    python benchmarks/hybrid_study.py efficiency --width 128 [--batch 1] [--steps 4]

``memory``: per-rank memory of a cosmoflow training step (batch 1) for 1-, 2-, 4- and
8-way spatial splits (N1, D2, D2H2, D2H2W2), from tracemalloc: ``held`` (parameters,
optimizer state, persistent gradient buckets, input block) and the step's peak working
memory above it.  The total is compared with the one-rank total / P (the issue's target
is <= 1.15x), and so is the working memory without gradients (activations, halos,
temporaries), which is the part spatial partitioning divides.

``efficiency``: at equal total cores, (1 rank x 2 threads) / (2 ranks x 1 thread, D2).

Prints Markdown tables for docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "cosmoflow-128.yaml"
LAYOUTS = {1: [], 2: ["parallel.depth=2"], 4: ["parallel.depth=2", "parallel.height=2"],
           8: ["parallel.depth=2", "parallel.height=2", "parallel.width=2"]}


def bench(ranks: int, overrides: list[str], threads: int, extra: list[str],
          script: str = "bench_hybrid.py") -> dict:
    """Run a benchmark script on ``ranks`` ranks and return its JSON result."""
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    sets = [arg for item in overrides for arg in ("--set", item)]
    command = [sys.executable, str(HERE / script), "--config", str(CONFIG),
               *sets, "--threads", str(threads), *extra]
    if ranks > 1:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        command = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks),
                   *command]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{"):])


def memory(widths: list[int], ways: list[int], steps: int) -> None:
    print("| W | ranks | strategy | stop | held MiB | step peak MiB | total MiB | "
          "total / (1-rank total / P) | work w/o grads / (1-rank / P) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for width in widths:
        base = None
        for p in ways:
            result = bench(p, [f"model.width={width}", "train.batch_size=1", *LAYOUTS[p]], 1,
                           ["--steps", str(steps), "--memory"])
            mem = result["memory_mib"]
            total = mem["held_max"] + mem["step_peak_max"]
            # one rank allocates its gradients during the step, several ranks hold them
            work = mem["step_peak_max"] - (result["param_mib"] if p == 1 else 0.0)
            if base is None:
                base = (total, work)
            print(f"| {width} | {p} | {result['strategy']} | {result['spatial_stop']} | "
                  f"{mem['held_max']:.0f} | {mem['step_peak_max']:.0f} | {total:.0f} | "
                  f"{total / (base[0] / p):.2f} | {work / (base[1] / p):.2f} |", flush=True)


def efficiency(width: int, batch: int, steps: int) -> None:
    common = [f"model.width={width}", f"train.batch_size={batch}"]
    extra = ["--steps", str(steps)]
    one = bench(1, common, 2, extra)
    two = bench(2, common + ["parallel.depth=2"], 1, extra)
    print("| layout | s/step | halo | allreduce | redistribution | compute |")
    print("|---|---|---|---|---|---|")
    for name, r in (("1 rank x 2 threads", one), ("2 ranks x 1 thread, D2", two)):
        b = r["breakdown_mean"]
        print(f"| {name} | {r['seconds_per_step']:.3f} | {b['halo']:.3f} | "
              f"{b['allreduce']:.3f} | {b['redistribution']:.3f} | {b['compute']:.3f} |")
    print(f"\nparallel efficiency = {one['seconds_per_step'] / two['seconds_per_step']:.3f}"
          f" (W={width}, batch {batch}, spatial stop of D2: {two['spatial_stop']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="study", required=True)
    mem = sub.add_parser("memory")
    mem.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    mem.add_argument("--ways", type=int, nargs="+", default=[1, 2, 4, 8])
    mem.add_argument("--steps", type=int, default=2)
    eff = sub.add_parser("efficiency")
    eff.add_argument("--width", type=int, default=128)
    eff.add_argument("--batch", type=int, default=1)
    eff.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.study == "memory":
        memory(args.widths, args.ways, args.steps)
    else:
        efficiency(args.width, args.batch, args.steps)


if __name__ == "__main__":
    main()
