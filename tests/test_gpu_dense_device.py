"""The dense head's own kernels (kernels/cuda/src/linear.cu) on a GPU: the host build's
bits (the same order of float32 operations, no fused multiply-add), and through the
front doors of kernels/linear.py under ``dense: kernels`` cuBLAS's results within
float32 summation error (tests/test_dense_kernels.py's bounds).  Needs cupy and a
visible CUDA device; skipped elsewhere (gpu_check.sh's tests stage runs it)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cuda_devices

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.skipif(cuda_devices() == 0, reason="no CUDA device visible")

from cuda_host import HostLauncher, need_compiler  # noqa: E402
from test_dense_kernels import U32, bounds, operands, references  # noqa: E402

from cosmotrain.kernels import linear  # noqa: E402
from cosmotrain.kernels.cuda import raw_linear  # noqa: E402
from cosmotrain.kernels.cuda.settings import ConvSettings  # noqa: E402
from cosmotrain.precision import bfloat16, widen  # noqa: E402

HEADS = [(1, 2048, 2048), (8, 2048, 256), (32, 256, 4), (8, 32768, 128), (32, 128, 64)]


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", HEADS, ids=str)
def test_device_bits_are_the_host_builds_and_cublas_within_summation_error(
        shape: tuple, name: str) -> None:
    dtype = bfloat16() if name == "bfloat16" else np.dtype(np.float32)
    host = operands(shape, dtype, seed=9)
    x, w, b, dy = (cupy.asarray(a) for a in host)
    kernels = ConvSettings(dense="kernels")
    ours = {"y": linear.linear_forward(x, w, b, settings=kernels),
            "dx": linear.linear_backward_data(dy, w, settings=kernels),
            "dw": linear.linear_backward_weight(x, dy, settings=kernels)[0]}
    theirs = {"y": linear.linear_forward(x, w, b),
              "dx": linear.linear_backward_data(dy, w),
              "dw": linear.linear_backward_weight(x, dy)[0]}
    need_compiler()
    launcher = HostLauncher()
    built = {"y": raw_linear.forward(*host[:3], launch=launcher),
             "dx": raw_linear.backward_data(host[3], host[1], launch=launcher),
             "dw": raw_linear.backward_weight(host[0], host[3], launch=launcher)[0]}
    chains = bounds(shape)
    for key, (want, absolute) in references(*host).items():
        got = cupy.asnumpy(ours[key])
        np.testing.assert_array_equal(widen(got), widen(built[key]), strict=True, err_msg=key)
        summed = (chains[key] + shape[1] + shape[2] + 1) * U32 * absolute
        rounding = 2.0 ** -7 * np.abs(want) if got.dtype == bfloat16() else 0
        assert (np.abs(widen(got) - widen(cupy.asnumpy(theirs[key]))) <= summed + rounding
                ).all(), key
