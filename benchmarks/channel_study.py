"""Channel/filter parallelism study (drives bench_channel.py); Markdown for PERFORMANCE.md.

    python benchmarks/channel_study.py memory     # weights + Adam state vs the ways
    python benchmarks/channel_study.py volume     # per-layer volume, counted vs formula
    python benchmarks/channel_study.py allreduce  # vs pure sample parallelism

All runs use the cosmoflow-128 config (Adam) at a small width, since weights do not
depend on it, and 1 BLAS thread per rank.
"""

from __future__ import annotations

import argparse

from hybrid_study import bench

MODELS = {"cosmoflow": ["model.name=cosmoflow"],
          "resnet3d-18": ["model.name=resnet3d", "model.depth=18"]}
GROUPS = {"C2 x": (2, ["parallel.channel=2", "parallel.channel_algorithm=x"]),
          "F2 y": (2, ["parallel.filter=2", "parallel.channel_algorithm=y"]),
          "C2F2 w": (4, ["parallel.channel=2", "parallel.filter=2",
                         "parallel.channel_algorithm=w"]),
          "F4 auto": (4, ["parallel.filter=4"]),
          "C2F4 w": (8, ["parallel.channel=2", "parallel.filter=4",
                         "parallel.channel_algorithm=w"])}


def run(ranks: int, overrides: list[str], steps: int = 2) -> dict:
    return bench(ranks, overrides, 1, ["--steps", str(steps)], script="bench_channel.py")


def memory(width: int) -> None:
    print("| model | strategy | G | split layers held MiB | their full MiB | held / full | "
          "1/G | total held MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for model, over in MODELS.items():
        for name, (ranks, strategy) in GROUPS.items():
            r = run(ranks, [*over, f"model.width={width}", "train.batch_size=8", *strategy])
            worst = max(r["memory_per_rank"], key=lambda m: m["split_held_mib"])
            print(f"| {model} | {name} | {ranks} | {worst['split_held_mib']:.2f} | "
                  f"{worst['split_full_mib']:.2f} | "
                  f"{worst['split_held_mib'] / worst['split_full_mib']:.4f} | "
                  f"{1 / ranks:.4f} | {worst['total_held_mib']:.2f} |", flush=True)


def volume(width: int) -> None:
    print("| strategy | layer | algorithm | c x f | collectives counted | formula | "
          "halo counted | formula |")
    print("|---|---|---|---|---|---|---|---|")
    cases = {"C2F2 x": (4, ["parallel.channel=2", "parallel.filter=2",
                            "parallel.channel_algorithm=x"]),
             "C2F2 y": (4, ["parallel.channel=2", "parallel.filter=2",
                            "parallel.channel_algorithm=y"]),
             "C2F2 w": GROUPS["C2F2 w"][:2],
             "D2F2 auto": (4, ["parallel.depth=2", "parallel.filter=2"])}
    for name, (ranks, strategy) in cases.items():
        r = run(ranks, [f"model.width={width}", "train.batch_size=4", *strategy])
        for layer, v in r["layers"].items():
            print(f"| {name} | {layer} | {v['algorithm']} | {v['factor'][0]} x "
                  f"{v['factor'][1]} | {v['collectives_counted']:.0f} | "
                  f"{v['collectives_formula']:.0f} | {v['halo_counted']:.0f} | "
                  f"{v['halo_formula']:.0f} |", flush=True)


def allreduce(width: int) -> None:
    print("| model | ranks | strategy | allreduce elements / rank / step | vs pure sample | "
          "allreduce s / step | s / step |")
    print("|---|---|---|---|---|---|---|")
    layouts = {4: {"N4": ["parallel.sample=4"], "C2F2 auto": GROUPS["C2F2 w"][1][:2],
                   "F4 auto": ["parallel.filter=4"]},
               8: {"N8": ["parallel.sample=8"],
                   "N2C2F2 auto": ["parallel.sample=2", "parallel.channel=2",
                                   "parallel.filter=2"]}}
    for model, over in MODELS.items():
        for ranks, strategies in layouts.items():
            base = None
            for name, strategy in strategies.items():
                r = run(ranks, [*over, f"model.width={width}", "train.batch_size=8",
                                *strategy], steps=3)
                elements = max(r["allreduce_elements_per_step"])
                base = base or elements
                print(f"| {model} | {ranks} | {name} | {elements:,.0f} | "
                      f"{elements / base:.3f} | "
                      f"{max(r['allreduce_seconds_per_step']):.4f} | "
                      f"{r['seconds_per_step']:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=("memory", "volume", "allreduce"))
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    {"memory": memory, "volume": volume, "allreduce": allreduce}[args.study](args.width)


if __name__ == "__main__":
    main()
