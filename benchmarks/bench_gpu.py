"""CosmoFlow's convolutions on one GPU: cosmotrain.kernels.cuda (cuDNN, gemm) vs PyTorch.

    python benchmarks/bench_gpu.py [--width 128] [--batch 1 8 32]
        [--precisions fp32 tf32 bf16] [--algorithms cudnn gemm] [--layouts ndhwc ncdhw]
        [--repeats 10] [--no-torch] [--torch-autotune] [--out results.json]

What is timed.  For every batch size, precision (fp32; tf32 = fp32 storage with TF32
tensor-core math; bf16 = bfloat16 storage, fp32 accumulation) and algorithm: the
convolutions of the default ``cosmoflow`` model at width W (conv1..conv7, shapes taken
from the model the trainer builds), each as forward + wgrad + dgrad (no dgrad for conv1,
as in training), through :mod:`cosmotrain.kernels.cuda.conv` on cupy arrays.  Figures are
samples/s of that convolution work (batch / sum of the per-layer medians, CUDA events)
and the per-layer milliseconds (JSON).  These are the layers that hold nearly all of a
CosmoFlow step's FLOPs; the engine's other layers and the optimizer on cupy are not part
of cosmotrain.kernels.cuda.conv, so the cosmotrain columns are *convolution* throughput,
not whole training steps (``benchmarks/bench_step.py`` times those).

PyTorch (when ``import torch`` works with CUDA): the same convolutions
(``F.conv3d``, ``torch.nn.grad.conv3d_weight`` / ``conv3d_input``; eager, NCDHW, cuDNN
autotuning off unless ``--torch-autotune``) in the same precisions (``allow_tf32``;
bf16 tensors), and for context the whole PyTorch training step of the same network
(forward + backward + Adam, ``torch.autocast(bfloat16)`` with fp32 master weights for
bf16), in samples/s.

Before timing, the algorithms are checked against each other on conv2 (batch 1): the
maximum relative difference per precision is printed and stored.

Prints a markdown table; ``--out`` writes everything as JSON.  Needs cupy and a CUDA GPU
(exit code 2 with a message otherwise); cuDNN columns need ``nvidia-cudnn-frontend`` and
``nvidia-cudnn-cu12``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cosmotrain.config.schema import ModelConfig  # noqa: E402
from cosmotrain.kernels.cuda import conv as gpu_conv  # noqa: E402
from cosmotrain.kernels.cuda.settings import ConvSettings  # noqa: E402
from cosmotrain.kernels.geometry import ConvGeometry  # noqa: E402
from cosmotrain.models import build_model  # noqa: E402
from cosmotrain.nn.layers import Conv3d  # noqa: E402

PRECISIONS = ("fp32", "tf32", "bf16")


@dataclass(frozen=True)
class ConvLayer:
    """One convolution of the network: per-sample input shape and its geometry."""

    name: str
    sample_shape: Tuple[int, ...]   # (C, D, H, W)
    w_shape: Tuple[int, ...]
    stride: Tuple[int, int, int]
    padding: Tuple[Tuple[int, int], ...]
    dgrad: bool                     # the first convolution computes no input gradient

    def flops(self, batch: int) -> float:
        geo = layer_geometry(self, batch)
        per_op = 2.0 * geo.rows * geo.filters * geo.plane * geo.out[0] * batch
        return per_op * (3 if self.dgrad else 2)


def require_gpu():
    """cupy with at least one CUDA device; otherwise a one-line reason and exit status 2."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, no driver, no device
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if count > 0:
            return cupy
        reason = "cupy sees no CUDA device"
    print(f"bench_gpu.py needs cupy and a CUDA GPU ({reason}); "
          "install with pip install -e \".[gpu]\" on a GPU machine", file=sys.stderr)
    raise SystemExit(2)


def cosmoflow_convs(width: int) -> Tuple[Any, List[ConvLayer]]:
    """The model the trainer builds and its convolutions in order, with input shapes."""
    model = build_model(ModelConfig(name="cosmoflow", width=width), seed=0)
    shape: Tuple[int, ...] = (1, model.items[0].in_channels, width, width, width)
    layers = []
    for layer in model.items:
        if isinstance(layer, Conv3d):
            layers.append(ConvLayer(layer.name, shape[1:], layer.params["weight"].shape,
                                    layer.stride, layer.padding, dgrad=bool(layers)))
        shape = layer.output_shape(shape)
    return model, layers


def storage_dtype(precision: str) -> np.dtype:
    if precision == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float32)


def gpu_median_ms(cupy, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median GPU time of ``fn()`` in ms (CUDA events on cupy's current stream)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def torch_median_ms(torch, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median GPU time of ``fn()`` in ms (CUDA events on torch's current stream)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_geometry(layer: ConvLayer, batch: int) -> ConvGeometry:
    return ConvGeometry.create((batch,) + layer.sample_shape, layer.w_shape, layer.stride,
                               layer.padding)


def layer_operands(cupy, layer: ConvLayer, batch: int, dtype, seed: int = 0):
    """(x, w, dy) random device arrays of one layer in the storage dtype."""
    rng = cupy.random.RandomState(seed)
    geo = layer_geometry(layer, batch)
    x = rng.standard_normal(geo.x_shape, dtype=np.float32).astype(dtype)
    w = (rng.standard_normal(geo.w_shape, dtype=np.float32) * 0.05).astype(dtype)
    dy = rng.standard_normal(geo.y_shape, dtype=np.float32).astype(dtype)
    return x, w, dy


def ours_layer_ms(cupy, layer: ConvLayer, batch: int, dtype, repeats: int,
                  settings: ConvSettings) -> Dict[str, float]:
    """Median ms of forward, wgrad (and dgrad) of one layer through kernels.cuda.conv
    under ``settings``."""
    x, w, dy = layer_operands(cupy, layer, batch, dtype)
    s, p = layer.stride, layer.padding
    ops = {"fwd": lambda: gpu_conv.conv3d_forward(x, w, s, p, settings=settings),
           "wgrad": lambda: gpu_conv.conv3d_backward_filter(x, dy, w.shape, s, p,
                                                            settings=settings)}
    if layer.dgrad:
        ops["dgrad"] = lambda: gpu_conv.conv3d_backward_data(dy, w, x.shape, s, p,
                                                             settings=settings)
    return {name: gpu_median_ms(cupy, fn, repeats) for name, fn in ops.items()}


def torch_flags(torch, precision: str, autotune: bool) -> None:
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = autotune


def torch_layer_ms(torch, layer: ConvLayer, batch: int, precision: str,
                   repeats: int) -> Dict[str, float]:
    """Median ms of the same layer's forward / wgrad / dgrad in PyTorch eager."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    geo = layer_geometry(layer, batch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w, dy = (torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
                for shape in (geo.x_shape, geo.w_shape, geo.y_shape))
    stride, pad = layer.stride, tuple(p[0] for p in layer.padding)
    ops = {"fwd": lambda: torch.nn.functional.conv3d(x, w, None, stride, pad),
           "wgrad": lambda: torch.nn.grad.conv3d_weight(x, w.shape, dy, stride, pad)}
    if layer.dgrad:
        ops["dgrad"] = lambda: torch.nn.grad.conv3d_input(x.shape, w, dy, stride, pad)
    return {name: torch_median_ms(torch, fn, repeats) for name, fn in ops.items()}


def torch_step_samples_per_s(torch, model, width: int, batch: int, precision: str,
                             repeats: int) -> float:
    """Samples/s of PyTorch's whole training step (forward, backward, Adam)."""
    from torch_mirror import torch_twin

    twin = torch_twin(model).cuda()
    opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    x = torch.randn(batch, model.items[0].in_channels, width, width, width, device="cuda")
    y = torch.randn(batch, 4, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = ((twin(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()

    return batch / (torch_median_ms(torch, step, repeats) / 1e3)


def import_torch_cuda():
    """torch when it is installed with a usable CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def agreement(cupy, layer: ConvLayer, precisions, algorithms) -> List[dict]:
    """Max relative difference of each algorithm's results from the fp32 gemm result
    (strict fp32, the most accurate path) on one layer at batch 1."""
    rows = []
    x, w, dy = layer_operands(cupy, layer, 1, np.float32, seed=1)
    reference = run_three(cupy, layer, x, w, dy, ConvSettings(algorithm="gemm", math="fp32"))
    for precision in precisions:
        dtype = storage_dtype(precision)
        for algo in algorithms:
            settings = select(algo, precision, "ndhwc")
            if settings is None:
                continue
            ours = run_three(cupy, layer, x.astype(dtype), w.astype(dtype), dy.astype(dtype),
                             settings)
            rows.append({"layer": layer.name, "precision": precision, "algorithm": algo,
                         **{op: rel_diff(ours[op], reference[op]) for op in reference}})
    return rows


def run_three(cupy, layer: ConvLayer, x, w, dy, settings: ConvSettings
              ) -> Dict[str, np.ndarray]:
    s, p, kw = layer.stride, layer.padding, {"settings": settings}
    return {"fwd": cupy.asnumpy(gpu_conv.conv3d_forward(x, w, s, p, **kw).astype(np.float32)),
            "wgrad": cupy.asnumpy(gpu_conv.conv3d_backward_filter(x, dy, w.shape, s, p, **kw)
                                  .astype(np.float32)),
            "dgrad": cupy.asnumpy(gpu_conv.conv3d_backward_data(dy, w, x.shape, s, p, **kw)
                                  .astype(np.float32))}


_skipped: set = set()


def select(algo: str, precision: str, layout: str) -> Optional[ConvSettings]:
    """The settings that run ``algo`` at ``precision``; None (and one message) when
    ``algo`` is unavailable.

    cuDNN is requested as ``auto`` so that a missing cuDNN skips its columns instead of
    raising; the resolved algorithm tells which one runs.
    """
    math = "tf32" if precision == "tf32" else "fp32"
    settings = ConvSettings(algorithm="auto" if algo == "cudnn" else algo, math=math,
                            cudnn_layout=layout)
    chosen, why = gpu_conv.algorithm(settings)
    if chosen != algo:
        if algo not in _skipped:
            _skipped.add(algo)
            print(f"skipping {algo}: {why}", file=sys.stderr)
        return None
    return settings


def measure(cupy, torch, model, layers: List[ConvLayer], args) -> List[dict]:
    """One result row per (batch, precision, implementation)."""
    rows = []
    release_cupy = cupy.get_default_memory_pool().free_all_blocks
    for batch in args.batch:
        for precision in args.precisions:
            dtype = storage_dtype(precision)
            for algo in args.algorithms:
                for layout in (args.layouts if algo == "cudnn" else ["-"]):
                    settings = select(algo, precision, "ndhwc" if layout == "-" else layout)
                    if settings is None:
                        continue
                    rows.append(timed_row(
                        Row(f"cosmotrain {algo}", layout, batch, precision), layers,
                        lambda layer: ours_layer_ms(cupy, layer, batch, dtype, args.repeats,
                                                    settings),
                        cupy.cuda.memory.OutOfMemoryError, release_cupy))
            if torch is None:
                continue
            torch_flags(torch, precision, args.torch_autotune)
            rows.append(timed_row(
                Row("torch convs", "ncdhw", batch, precision), layers,
                lambda layer: torch_layer_ms(torch, layer, batch, precision, args.repeats),
                torch.cuda.OutOfMemoryError, torch.cuda.empty_cache))
            rows.append(torch_step_row(torch, model, args, batch, precision))
    return rows


@dataclass(frozen=True)
class Row:
    impl: str
    layout: str
    batch: int
    precision: str


def timed_row(row: Row, layers: List[ConvLayer],
              time_layer: Callable[[ConvLayer], Dict[str, float]], oom: type,
              release: Callable[[], None]) -> dict:
    """Per-layer times and the convolution samples/s; 'out of memory' when it does not fit."""
    try:
        per_layer = {layer.name: time_layer(layer) for layer in layers}
    except oom:
        return {**asdict(row), "status": "out of memory"}
    finally:
        release()
    total_ms = sum(sum(ops.values()) for ops in per_layer.values())
    flops = sum(layer.flops(row.batch) for layer in layers)
    print(f"{row.impl:18} {row.layout:6} batch {row.batch:3} {row.precision}: "
          f"{total_ms:9.2f} ms, {row.batch / total_ms * 1e3:8.1f} samples/s", flush=True)
    return {**asdict(row), "status": "ok", "conv_ms": total_ms, "per_layer_ms": per_layer,
            "samples_per_s": row.batch / (total_ms / 1e3), "tflops": flops / total_ms / 1e9}


def torch_step_row(torch, model, args, batch: int, precision: str) -> dict:
    row = Row("torch full step", "ncdhw", batch, precision)
    try:
        rate = torch_step_samples_per_s(torch, model, args.width, batch, precision,
                                        args.repeats)
    except torch.cuda.OutOfMemoryError:
        return {**asdict(row), "status": "out of memory"}
    finally:
        torch.cuda.empty_cache()
    print(f"{row.impl:18} {row.layout:6} batch {batch:3} {precision}: "
          f"{'':12} {rate:8.1f} samples/s", flush=True)
    return {**asdict(row), "status": "ok", "samples_per_s": rate}


def column_label(impl: str, layout: str) -> str:
    return f"{impl} ({layout})" if impl == "cosmotrain cudnn" else impl


def markdown(rows: List[dict]) -> str:
    """samples/s: one line per (batch, precision), one column per implementation."""
    columns = list(dict.fromkeys((r["impl"], r["layout"]) for r in rows))
    keys = list(dict.fromkeys((r["batch"], r["precision"]) for r in rows))
    lines = ["| batch | precision | " + " | ".join(column_label(*c) for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    found = {(r["impl"], r["layout"], r["batch"], r["precision"]): r for r in rows}
    for batch, precision in keys:
        cells = []
        for impl, layout in columns:
            r = found.get((impl, layout, batch, precision))
            cells.append("" if r is None else r["status"] if r["status"] != "ok"
                         else f"{r['samples_per_s']:.1f}")
        lines.append(f"| {batch} | {precision} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(cupy, torch) -> dict:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info = {"gpu": name, "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"),
            "cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cudnn": gpu_conv.cudnn_status()[1], "numpy": np.__version__}
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_cudnn"] = torch.backends.cudnn.version()
    return info


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--algorithms", nargs="+", default=["cudnn", "gemm"],
                        choices=["cudnn", "gemm"])
    parser.add_argument("--layouts", nargs="+", default=["ndhwc", "ncdhw"],
                        choices=["ndhwc", "ncdhw"], help="layouts handed to cuDNN")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (median shown)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--torch-autotune", action="store_true",
                        help="torch.backends.cudnn.benchmark = True")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    cupy = require_gpu()
    torch = None if args.no_torch else import_torch_cuda()
    model, layers = cosmoflow_convs(args.width)
    info = machine(cupy, torch)
    print(f"# CosmoFlow W={args.width} convolutions on {info['gpu']} ({info['date']}); "
          f"cupy {info['cupy']}, {info['cudnn']}"
          + (f", torch {info['torch']}" if torch is not None else ", no torch"))
    check = agreement(cupy, next(layer for layer in layers if layer.name == "conv2"),
                      args.precisions, args.algorithms)
    for row in check:
        print(f"agreement {row['layer']} {row['precision']} {row['algorithm']}: "
              + ", ".join(f"{op} {row[op]:.1e}" for op in ("fwd", "dgrad", "wgrad")))
    rows = measure(cupy, torch, model, layers, args)
    print("\nsamples/s (cosmotrain and torch convs: convolution work of one training step; "
          "torch full step: everything)\n")
    print(markdown(rows))
    if args.out:
        payload = {"machine": info, "args": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in vars(args).items()},
                   "layers": [asdict(layer) for layer in layers], "agreement": check,
                   "results": rows}
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
