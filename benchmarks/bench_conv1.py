"""conv1 on one GPU: cuDNN with 4 channels, cuDNN padded to 8, our direct kernel, PyTorch.

    python benchmarks/bench_conv1.py [--width 128] [--batch 1 8] [--precisions fp32 bf16]
        [--networks paper mlperf] [--repeats 10] [--no-torch] [--out results.json]

(``--precisions`` also takes ``tf32``: float32 storage with TF32 tensor-core math.)

What is timed (issue 35 item 5; docs/GPU_KERNELS.md, "conv1"): each network's first
convolution at width W (paper: 4 -> 16, no bias, the LeakyReLU(0.01) after it fused;
MLPerf: 4 -> 32 with bias, the max pooling after it), through the front door the layers
call (:func:`cosmotrain.kernels.conv3d.conv3d_forward`, so each forward includes its
epilogue: bias + LeakyReLU in ``epilogue.cu`` after cuDNN, inside the direct kernel),
and its weight gradient (:func:`conv3d_backward_filter`), under three settings:

* ``cudnn``: ``device.conv_algorithm: cudnn``, 4 channels, as today;
* ``cudnn pad8``: ``device.conv1_channels_pad: 8`` (zero channels for the tensor-core
  engines; the padding copies are timed with it);
* ``direct``: ``device.conv1_algorithm: direct`` (``src/conv_direct.cu``: the forward
  with its epilogue in one launch, the weight gradient in two);

and, when ``import torch`` works with CUDA, PyTorch eager's ``F.conv3d`` (+ bias and
``F.leaky_relu`` where the layer has them) and ``torch.nn.grad.conv3d_weight``.  Each
figure is the median of ``--repeats`` runs (CUDA events) after two warm-up runs, with the
TFLOP/s it makes and the largest difference from the ``cudnn`` row's result relative to
its largest value (a check that the three agree on the device).

Prints a markdown table; ``--out`` writes the rows as JSON.  Needs cupy and a CUDA device
(exit code 2 with a message otherwise).  ``measure`` takes the array module, the
algorithm and the timer, so tests/test_bench_conv1.py runs every case on the CPU through
the stand-in cupy (gemm standing in for cuDNN).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import (gpu_median_ms, import_torch_cuda, rel_diff,  # noqa: E402
                       storage_dtype, torch_median_ms)
from bench_raw_kernels import require_device  # noqa: E402
from cosmotrain.device.xp import to_host  # noqa: E402
from cosmotrain.kernels import conv3d  # noqa: E402
from cosmotrain.kernels.cuda.settings import ConvSettings  # noqa: E402

# network -> (filters, bias, LeakyReLU slope fused into the forward or None)
NETWORKS = {"paper": (16, False, 0.01), "mlperf": (32, True, None)}
Timer = Callable[[Callable[[], Any], int], float]


def settings(algorithm: str, precision: str) -> dict[str, ConvSettings]:
    """The three ways of running conv1 on ``algorithm`` (cudnn; gemm in the tests); TF32
    math under ``tf32`` (float32 storage: the only way fp32 reaches tensor cores)."""
    math = "tf32" if precision == "tf32" else "fp32"
    return {algorithm: ConvSettings(algorithm=algorithm, math=math),
            f"{algorithm} pad8": ConvSettings(algorithm=algorithm, math=math,
                                              conv1_channels_pad=8),
            "direct": ConvSettings(algorithm=algorithm, math=math, conv1_algorithm="direct")}


def operands(xp: Any, network: str, width: int, batch: int, dtype: Any) -> dict[str, Any]:
    """x, w, bias (or None) and dy of one network's conv1, on the device."""
    filters, has_bias, _ = NETWORKS[network]
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> Any:
        return xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    return {"x": normal(batch, 4, width, width, width), "w": normal(filters, 4, 3, 3, 3),
            "bias": normal(filters) if has_bias else None,
            "dy": normal(batch, filters, width, width, width)}


def flops(network: str, width: int, batch: int) -> float:
    """Multiply-adds x 2 of one pass (the forward, or the weight gradient)."""
    return 2.0 * NETWORKS[network][0] * 4 * 27 * width ** 3 * batch


def measure(xp: Any, network: str, width: int, batch: int, precision: str, algorithm: str,
            repeats: int, timer: Timer) -> list[dict]:
    """One row per (setting, pass): ms, TFLOP/s and the difference from the first
    setting's result."""
    ops = operands(xp, network, width, batch, storage_dtype(precision))
    slope = NETWORKS[network][2]
    rows, reference = [], {}
    for name, chosen in settings(algorithm, precision).items():
        def forward(chosen: ConvSettings = chosen) -> Any:
            return conv3d.conv3d_forward(ops["x"], ops["w"], 1, 1, settings=chosen,
                                         bias=ops["bias"], activation=slope)

        def wgrad(chosen: ConvSettings = chosen) -> Any:
            return conv3d.conv3d_backward_filter(ops["x"], ops["dy"], ops["w"].shape, 1, 1,
                                                 settings=chosen)
        for kind, fn in (("forward", forward), ("wgrad", wgrad)):
            out = to_host(fn()).astype(np.float32)
            reference.setdefault(kind, out)
            rows.append(row(network, width, batch, precision, name, kind,
                            timer(fn, repeats), rel_diff(out, reference[kind])))
    return rows


def row(network: str, width: int, batch: int, precision: str, how: str, kind: str,
        ms: float, diff: Any) -> dict:
    return {"network": network, "width": width, "batch": batch, "precision": precision,
            "how": how, "pass": kind, "ms": ms,
            "tflops": flops(network, width, batch) / (ms * 1e9) if ms > 0 else None,
            "rel_diff": diff}


def torch_rows(torch: Any, network: str, width: int, batch: int, precision: str,
               repeats: int) -> list[dict]:
    """PyTorch eager's conv1 (with its bias and activation) and weight gradient."""
    functional = torch.nn.functional
    filters, has_bias, slope = NETWORKS[network]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype) for shape in
                ((batch, 4, width, width, width), (filters, 4, 3, 3, 3),
                 (batch, filters, width, width, width)))
    bias = torch.randn(filters, device="cuda", dtype=dtype) if has_bias else None

    def forward() -> Any:
        y = functional.conv3d(x, w, bias, 1, 1)
        return y if slope is None else functional.leaky_relu(y, slope)
    times = {"forward": torch_median_ms(torch, forward, repeats),
             "wgrad": torch_median_ms(torch, lambda: torch.nn.grad.conv3d_weight(
                 x, w.shape, dy, 1, 1), repeats)}
    return [row(network, width, batch, precision, "torch", kind, ms, None)
            for kind, ms in times.items()]


def table(rows: list[dict]) -> str:
    lines = ["| network | batch | precision | how | pass | ms | TFLOP/s | rel. diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"
        tflops = "" if r["tflops"] is None else f"{r['tflops']:.1f}"
        lines.append(f"| {r['network']} | {r['batch']} | {r['precision']} | {r['how']} | "
                     f"{r['pass']} | {r['ms']:.3f} | {tflops} | {diff} |")
    return "\n".join(lines)


def parse(argv: Any = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "tf32", "bf16"])
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=NETWORKS)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def run(xp: Any, args: argparse.Namespace, algorithm: str, timer: Timer,
        torch: Any = None) -> list[dict]:
    """Every row the arguments ask for, PyTorch's beside ours when ``torch`` is given;
    the table printed and, with ``--out``, written as JSON."""
    rows = []
    for network in args.networks:
        for batch in args.batch:
            for precision in args.precisions:
                rows += measure(xp, network, args.width, batch, precision, algorithm,
                                args.repeats, timer)
                if torch is not None:
                    rows += torch_rows(torch, network, args.width, batch, precision,
                                       args.repeats)
                xp.get_default_memory_pool().free_all_blocks()
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
    return rows


def main(argv: Any = None) -> int:
    args = parse(argv)
    cupy = require_device("bench_conv1")
    torch = None if args.no_torch else import_torch_cuda()
    run(cupy, args, "cudnn", lambda fn, n: gpu_median_ms(cupy, fn, n), torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
