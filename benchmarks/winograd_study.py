"""Would Winograd convolution pay on this CPU?  Transform cost against the GEMM flops saved.

For each stride-1 3x3x3 layer of cosmoflow-mlperf at W=128 (one sample, one core: one
BLAS thread, process CPU time, so that other load on a shared box counts little) this
times the forward convolution of the kernels in ``cosmotrain.kernels.conv3d`` against the
parts of Winograd forms, each written with whole-array numpy passes over contiguous
parity-split arrays (the fastest layout measured for numpy here):

* ``F(2x2, 3x3)`` over (H, W), depth lowered as in the H-and-W split: 16 points, GEMMs
  ``(F x 3C) @ (3C x tiles)`` per output plane, 2.25x fewer flops;
* ``F(2x2x2, 3x3x3)``: 64 points, GEMMs ``(F x C) @ (C x tiles)``, 3.375x fewer flops;
* ``F(2, 3)`` along W only (``w``; ``h``: along H): 4 components, the data expands only
  2x; each component is an ordinary convolution over the two other axes with a 3x3x1
  (3x1x3) kernel, run by ``conv3d_forward`` itself (its lowering and GEMMs), on a plane
  half as wide; 1.5x fewer flops.  Its weight transform (once per step, amortised over
  the batch) is timed apart.

Each form is checked against ``conv3d_forward`` (float64, a small case; float32 on conv3)
before timing.  The direct convolution and every part are interleaved, round by round;
"end to end" runs the parts back to back; what a real kernel adds (chunking, thread
hand-offs) only makes it slower.  Results: docs/PERFORMANCE.md, "cosmoflow-mlperf per
layer against PyTorch" (2026-11-23: F(2,3)-W 0.9-1.0x on conv2, 1.2-1.4x on conv3..5).

    python benchmarks/winograd_study.py [--width 128] [--repeat 3] [--forms 2d 3d w h]
        [--layers conv2 conv3 conv4 conv5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.conv3d import conv3d_forward

LAYERS = [("conv2", 32, 64, 2), ("conv3", 64, 128, 4), ("conv4", 128, 256, 8),
          ("conv5", 256, 512, 16)]  # name, C, F, input size as a fraction of W
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def _take(a: np.ndarray, axis: int, start: int, count: int) -> np.ndarray:
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, start + count)
    return a[tuple(index)]


def split_parity(x: np.ndarray, axes: List[int]) -> np.ndarray:
    """Pad x by one on both sides of ``axes`` (rounded up to even) and split each of them
    into (parity, index): parities become leading axes, in the order of ``axes``."""
    pad = [(0, 0)] * x.ndim
    for ax in axes:
        pad[ax] = (1, 1 + x.shape[ax] % 2)
    xp = np.pad(x, pad)
    parts = [xp]
    for ax in axes:
        parts = [p[(slice(None),) * ax + (slice(r, None, 2),)] for p in parts for r in (0, 1)]
    out = np.empty((2,) * len(axes) + parts[0].shape, x.dtype)
    for flat, part in enumerate(parts):
        out[np.unravel_index(flat, (2,) * len(axes))] = part
    return out


def b_stage(s: np.ndarray, parity_axis: int, axis: int) -> np.ndarray:
    """``B^T`` along one split axis: taps (parity, offset) (0,0) (1,0) (0,1) (1,1); the
    parity axis is consumed and a points axis of 4 is put in front."""
    t = s.shape[axis] - 1
    taps = [_take(np.take(s, a % 2, axis=parity_axis), axis - 1, a // 2, t) for a in range(4)]
    out = np.empty((4,) + taps[0].shape, s.dtype)
    np.subtract(taps[0], taps[2], out=out[0])
    np.add(taps[1], taps[2], out=out[1])
    np.subtract(taps[2], taps[1], out=out[2])
    np.subtract(taps[1], taps[3], out=out[3])
    return out


def a_stage(m: np.ndarray, axis: int) -> np.ndarray:
    """``A^T`` along a points axis of 4 -> 2 outputs (put in front)."""
    p = [np.take(m, i, axis=axis) for i in range(4)]
    out = np.empty((2,) + p[0].shape, m.dtype)
    np.add(p[1], p[2], out=out[0])
    out[0] += p[0]
    np.subtract(p[1], p[2], out=out[1])
    out[1] -= p[3]
    return out


def interleave(parts: np.ndarray, dims: int, y: np.ndarray) -> None:
    """``y[..., 2t + u, ...] = parts[u, ..., t, ...]`` for the last ``dims`` axes."""
    for index in np.ndindex((2,) * dims):
        view = y[(Ellipsis,) + tuple(slice(u, None, 2) for u in index)]
        np.copyto(view, parts[index])


def winograd_3d(x: np.ndarray, w: np.ndarray) -> Dict[str, Callable[[], object]]:
    """The three timed parts of F(2x2x2, 3x3x3) for one sample ``x`` (C, D, H, W)."""
    c, f = x.shape[0], w.shape[0]
    k = np.kron(np.kron(_G, _G), _G)  # (64, 27)
    u = (k @ w.reshape(f * c, 27).T.astype(np.float64)).reshape(64, f, c).astype(x.dtype)
    state: dict = {}

    def inputs():
        s = split_parity(x, [1, 2, 3])  # (2, 2, 2, C, D', H', W')
        s = b_stage(s, 2, 6)            # (4e, 2, 2, C, D', H', tw)
        s = b_stage(s, 2, 5)            # (4b, 4e, 2, C, D', th, tw)
        s = b_stage(s, 2, 4)            # (4a, 4b, 4e, C, td, th, tw)
        state["v"] = s.reshape(64, c, -1)
        state["tiles"] = s.shape[4:]

    def gemms():
        state["m"] = np.matmul(u, state["v"])

    def outputs():
        m = state["m"].reshape((4, 4, 4, f) + state["tiles"])
        for _ in range(3):  # e, then b, then a: each stage puts its 2 outputs first
            m = a_stage(m, 2)
        y = np.empty((f,) + tuple(2 * t for t in state["tiles"]), x.dtype)
        interleave(m, 3, y)
        state["y"] = y[:, :x.shape[1], :x.shape[2], :x.shape[3]]

    return {"input transform": inputs, "GEMMs": gemms, "output transform": outputs,
            "_result": lambda: state["y"]}


def winograd_2d(x: np.ndarray, w: np.ndarray) -> Dict[str, Callable[[], object]]:
    """The three timed parts of F(2x2, 3x3) over (H, W), depth lowered by windows."""
    c, f, d = x.shape[0], w.shape[0], x.shape[1]
    u = np.einsum("ib,fcabe,je->ijfac", _G, w.astype(np.float64), _G)
    u = np.ascontiguousarray(u.reshape(16, f, 3 * c).astype(x.dtype))
    state: dict = {}

    def inputs():
        xd = np.pad(x, ((0, 0), (1, 1), (0, 0), (0, 0))).transpose(1, 0, 2, 3)  # (D', C, H, W)
        s = split_parity(np.ascontiguousarray(xd), [2, 3])  # (2, 2, D', C, H', W')
        s = b_stage(s, 1, 5)            # (4j, 2, D', C, H', tw)
        s = b_stage(s, 1, 4)            # (4i, 4j, D', C, th, tw)
        state["tiles"] = s.shape[4:]
        state["v"] = np.ascontiguousarray(s.reshape(16, d + 2, c, -1))

    def gemms():
        v = state["v"]
        m = np.empty((16, d, f, v.shape[-1]), x.dtype)
        for z in range(d):
            np.matmul(u, v[:, z:z + 3].reshape(16, 3 * c, -1), out=m[:, z])
        state["m"] = m

    def outputs():
        m = state["m"].reshape((4, 4, d, f) + state["tiles"])
        m = a_stage(a_stage(m, 1), 1)    # (2v, 2u, D, F, th, tw)
        y = np.empty((f, d) + tuple(2 * t for t in state["tiles"]), x.dtype)
        interleave(m.transpose(0, 1, 3, 2, 4, 5), 2, y)
        state["y"] = y[:, :, :x.shape[2], :x.shape[3]]

    return {"input transform": inputs, "GEMMs": gemms, "output transform": outputs,
            "_result": lambda: state["y"]}


def winograd_1d(x: np.ndarray, w: np.ndarray, axis: int = 3) -> Dict[str, Callable[[], object]]:
    """The three timed parts of F(2, 3) along one axis of ``x`` (C, D, H, W): W (3) or H (2).

    Input tiles of 4 with stride 2 along ``axis`` give 4 components (``B^T``: d0-d2,
    d1+d2, d2-d1, d1-d3; the data expands 2x); the kernel's taps along ``axis`` become
    (g0, (g0+g1+g2)/2, (g0-g1+g2)/2, g2); each component is convolved over the two other
    axes by ``conv3d_forward`` itself (kernel 3x3x1 for W, 3x1x3 for H, on a plane half
    as long along ``axis``: the real lowering and GEMMs), and ``y0 = m0+m1+m2``,
    ``y1 = m1-m2-m3`` are interleaved along ``axis``.  36 multiplications per 2 outputs
    instead of 54: 1.5x fewer GEMM flops.
    """
    f = w.shape[0]
    pad = [(1, 1), (1, 1), (1, 1)]
    pad[axis - 1] = (0, 0)
    state: dict = {}

    def weights():  # once per training step (per batch), in the weights' dtype
        u = np.tensordot(_G.astype(w.dtype), w, axes=([1], [axis + 1]))  # (4, F, C, a, b)
        state["u"] = np.ascontiguousarray(np.expand_dims(u, axis + 2))

    def inputs():
        s = split_parity(x, [axis])      # (2, C, D, H', W') split along axis
        state["v"] = b_stage(s, 0, axis + 1)[:, None]  # (4, 1, C, ...) tiles along axis

    def convs():
        v = state["v"]
        shape = (4, 1, f) + v.shape[3:]
        m = state.get("m")
        if m is None or m.shape != shape:
            m = state["m"] = np.empty(shape, x.dtype)
        for i in range(4):
            conv3d_forward(v[i], state["u"][i], 1, pad, out=m[i])

    def outputs():
        m = state["m"][:, 0]             # (4, F, D, H, W) half length along axis
        y2 = a_stage(m, 0)               # (2, F, ...)
        shape = list(m.shape[1:])
        shape[axis] *= 2
        y = np.empty(shape, x.dtype)
        for t in range(2):
            index = [slice(None)] * 4
            index[axis] = slice(t, None, 2)
            np.copyto(y[tuple(index)], y2[t])
        state["y"] = _take(y, axis, 0, x.shape[axis])

    weights()
    return {"input transform": inputs, "convs": convs, "output transform": outputs,
            "_weights": weights, "_result": lambda: state["y"]}


def check(form: Callable, rng) -> float:
    """Largest relative difference of the form against ``conv3d_forward`` (float64)."""
    x = rng.standard_normal((3, 6, 7, 5))
    w = rng.standard_normal((4, 3, 3, 3, 3))
    return relative_error(form, x, w)


def relative_error(form: Callable, x: np.ndarray, w: np.ndarray) -> float:
    """``max |form(x, w) - conv3d_forward(x, w)| / max |conv3d_forward(x, w)|``."""
    parts = form(x, w)
    for name in _steps(parts):
        parts[name]()
    ref = conv3d_forward(x[None], w, 1, 1)[0]
    return float(np.abs(parts["_result"]() - ref).max() / np.abs(ref).max())


def _steps(parts: Dict[str, Callable[[], object]]) -> List[str]:
    return [name for name in parts if not name.startswith("_")]


def winograd_w(x: np.ndarray, w: np.ndarray) -> Dict[str, Callable[[], object]]:
    return winograd_1d(x, w, 3)


def winograd_h(x: np.ndarray, w: np.ndarray) -> Dict[str, Callable[[], object]]:
    return winograd_1d(x, w, 2)


FORMS = {"2d": ("F(2x2,3x3)", winograd_2d), "3d": ("F(2x2x2,3x3x3)", winograd_3d),
         "w": ("F(2,3)-W", winograd_w), "h": ("F(2,3)-H", winograd_h)}


def cpu_time(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def float32_check(forms: List[str], width: int, rng) -> None:
    """float32 on a real layer (conv3) against conv3d_forward in float32, and both
    against float64, as max |difference| / max |reference|."""
    layer, c, f, frac = LAYERS[1]
    x = rng.standard_normal((c,) + (width // frac,) * 3, dtype=np.float32)
    w = rng.standard_normal((f, c, 3, 3, 3), dtype=np.float32) * 0.1
    ref64 = conv3d_forward(x[None].astype(np.float64), w.astype(np.float64), 1, 1)[0]
    ref32 = conv3d_forward(x[None], w, 1, 1)[0]
    scale = np.abs(ref64).max()
    print(f"float32 {layer} {c}->{f} {width // frac}^3: conv3d_forward against float64 "
          f"{np.abs(ref32 - ref64).max() / scale:.1e}")
    for key in forms:
        name, form = FORMS[key]
        parts = form(x, w)
        for step in _steps(parts):
            parts[step]()
        y = parts["_result"]()
        print(f"  {name}: against float32 conv3d_forward "
              f"{np.abs(y - ref32).max() / np.abs(ref32).max():.1e}, against float64 "
              f"{np.abs(y - ref64).max() / scale:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--forms", nargs="+", choices=sorted(FORMS), default=["2d", "3d", "w"])
    parser.add_argument("--layers", nargs="+", default=[name for name, *_ in LAYERS])
    args = parser.parse_args()
    workers.set_blas_threads(1)
    rng = np.random.default_rng(0)
    for key in args.forms:
        name, form = FORMS[key]
        print(f"{name} check against conv3d_forward: max relative difference "
              f"{check(form, rng):.1e}")
    float32_check(args.forms, args.width, rng)
    print(f"\ncosmoflow-mlperf W={args.width}, one sample, one core, CPU ms (median of "
          f"{args.repeat} rounds, direct and every part interleaved), "
          f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| layer | direct | form | weight transform | input transform | GEMMs / convs | "
          "output transform | sum of parts | end to end | direct / end to end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layer, c, f, frac in LAYERS:
        if layer not in args.layers:
            continue
        size = args.width // frac
        x = rng.standard_normal((c, size, size, size), dtype=np.float32)
        w = rng.standard_normal((f, c, 3, 3, 3), dtype=np.float32) * 0.1
        forms = [(FORMS[key][0], FORMS[key][1](x, w)) for key in args.forms]
        direct: List[float] = []
        times: Dict[str, List[List[float]]] = {name: [] for name, _ in forms}
        whole: Dict[str, List[float]] = {name: [] for name, _ in forms}
        for _ in range(args.repeat):
            direct.append(cpu_time(lambda: conv3d_forward(x[None], w, 1, 1)))
            for name, parts in forms:
                steps = [parts[step] for step in _steps(parts)]
                times[name].append([cpu_time(parts.get("_weights", lambda: None))]
                                   + [cpu_time(step) for step in steps])
                whole[name].append(cpu_time(lambda: [step() for step in steps]))
        d = statistics.median(direct) * 1e3
        for name, parts in forms:
            ms = [statistics.median(col) * 1e3 for col in zip(*times[name])]
            e2e = statistics.median(whole[name]) * 1e3
            cells = ["-" if "_weights" not in parts else f"{ms[0]:.1f}"]
            cells += [f"{v:.0f}" for v in ms[1:]]
            print(f"| {layer} {c}->{f} {size}^3 | {d:.0f} | {name} | " + " | ".join(cells)
                  + f" | {sum(ms[1:]):.0f} | {e2e:.0f} | {d / e2e:.2f} |", flush=True)
        del forms


if __name__ == "__main__":
    main()
