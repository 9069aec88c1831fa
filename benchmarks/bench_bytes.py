"""Issue 35's byte budget at full width, on the CPU: bytes moved by a GPU training step
against its compulsory traffic, and its launches.

    python benchmarks/bench_bytes.py [--width 128] [--batch 1]
        [--networks cosmoflow mlperf] [--precisions fp32 bf16] [--top 8]

What is measured.  The engine's real GPU step runs on the stand-in cupy of
tests/standin.py (no GPU needed), convolutions recorded as one cuDNN launch each
(tests/standin_bytes.py); the second step, the steady state, is counted: the bytes its
launches read and write (their operands' sizes), against the compulsory traffic of
tests/compulsory_traffic.py (derived from the layer shapes alone), and the number of
launches.  Prints a markdown table and, per row, the kernels that move the most bytes.
docs/PERFORMANCE.md, "GPU: compulsory traffic", records the figures; CI checks the same
ratio at W = 32 (tests/test_byte_budget.py).  One W = 128 step takes 7-15 s here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import pytest  # noqa: E402
from byte_budget import Measurement, measure  # noqa: E402


def row(found: Measurement, seconds: float) -> str:
    mb = 1e6
    return (f"| {found.network} | {found.precision} | {found.width} | {found.batch} | "
            f"{found.moved / mb:,.0f} | {found.compulsory / mb:,.0f} | {found.ratio:.2f} | "
            f"{found.launches} | {seconds:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--networks", nargs="+", default=["cosmoflow", "mlperf"],
                        choices=["cosmoflow", "mlperf"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"])
    parser.add_argument("--top", type=int, default=8, help="heaviest kernels listed")
    args = parser.parse_args(argv)
    rows, heaviest = [], []
    for network in args.networks:
        for precision in args.precisions:
            patch = pytest.MonkeyPatch()
            start = time.perf_counter()
            try:
                found = measure(patch, network, args.width, precision, args.batch)
            finally:
                patch.undo()
            rows.append(row(found, time.perf_counter() - start))
            heaviest.append(f"- {network} {precision}: " + ", ".join(
                f"{kernel} {moved / 1e6:,.0f} MB" for kernel, moved in found.heaviest(args.top)))
    print("| network | precision | W | batch | moved MB | compulsory MB | ratio | launches "
          "| s (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nHeaviest kernels (bytes read + written):")
    print("\n".join(heaviest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
