"""NCDHW versus channels-last internal layout for the CPU conv3d forward kernel.

Both variants run chunked GEMM lowerings on the CosmoFlow layers (W=128, batch 1, k3 p1),
in the same process, with the same worker pool:

* ncdhw: the production kernel (``conv3d_forward``: NCDHW slabs, column matrices copied
  in runs of Wo floats, W-split GEMM ``(F*kW, C*kD*kH) @ cols`` and shifted adds);
* channels-last: slab transposed to (d, h, w, C) while padding, column matrix (n, 27*C)
  (inner copy runs of kW*C floats), GEMM  cols (n, K) @ W^T (K, F), then the (n, F) block
  is transposed back into the NCDHW output.

Run:  python benchmarks/bench_conv_layout.py      (OPENBLAS_CORETYPE=SkylakeX to compare
the AVX-512 GEMM kernels on CPUs that OpenBLAS does not detect as such).
"""

from __future__ import annotations

import time

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np
from numpy.lib.stride_tricks import as_strided

from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.conv3d import conv3d_forward
from cosmotrain.kernels.geometry import plan_chunks
from cosmotrain.kernels.cpu.lowering import fill_slab

LAYERS = [("conv1", 4, 16, 128), ("conv2", 16, 32, 64), ("conv3", 32, 64, 32)]
BUDGET = 4 << 20


def forward_channels_last(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """k3 s1 p1 forward through a channels-last column matrix (prototype)."""
    n_, c, d, h, wd = x.shape
    f = w.shape[0]
    wcl = np.ascontiguousarray(w.transpose(2, 3, 4, 1, 0).reshape(27 * c, f))
    y = np.empty((n_, f, d, h, wd), x.dtype)

    def work(chunk):
        n, z0, z1 = chunk
        s = z1 - z0
        slab = workers.scratch("cl_slab", (c, s + 2, h + 2, wd + 2), x.dtype)
        fill_slab(slab, x[n], (z0 - 1, -1, -1))
        slab_cl = workers.scratch("cl_slab_t", (s + 2, h + 2, wd + 2, c), x.dtype)
        np.copyto(slab_cl, slab.transpose(1, 2, 3, 0))
        sd, sh, sw, sc = slab_cl.strides
        win = as_strided(slab_cl, (s, h, wd, 3, 3, 3 * c), (sd, sh, sw, sd, sh, sc),
                         writeable=False)
        cols = workers.scratch("cl_cols", (s * h * wd, 27 * c), x.dtype)
        np.copyto(cols.reshape(s, h, wd, 3, 3, 3 * c), win)
        out = workers.scratch("cl_out", (s * h * wd, f), x.dtype)
        np.matmul(cols, wcl, out=out)
        np.copyto(y[n, :, z0:z1].reshape(f, -1), out.T)

    per_plane = 27 * c * h * wd * x.itemsize
    workers.map_chunks(work, plan_chunks(n_, d, max(1, BUDGET // per_plane)))
    return y


def best_of(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'layer':6} {'NCDHW ms':>9} {'chan-last ms':>13} {'CL/NCDHW':>9}")
    for name, c, f, s in LAYERS:
        x = rng.standard_normal((1, c, s, s, s), dtype=np.float32)
        w = rng.standard_normal((f, c, 3, 3, 3), dtype=np.float32)
        ref = conv3d_forward(x, w, 1, 1)
        np.testing.assert_allclose(forward_channels_last(x, w), ref, rtol=1e-4, atol=1e-3)
        t_nc = best_of(lambda: conv3d_forward(x, w, 1, 1))
        t_cl = best_of(lambda: forward_channels_last(x, w))
        print(f"{name:6} {t_nc * 1e3:9.1f} {t_cl * 1e3:13.1f} {t_cl / t_nc:9.2f}")


if __name__ == "__main__":
    main()
