"""Our CUDA kernels (kernels/cuda/src/*.cu) on a GPU, loaded by kernels/cuda/raw.py, against
the CPU kernels: the bits tests/test_cuda_kernels_host.py shows for the host build of
the same sources, now from the device's compiler (NVRTC, fused multiply-adds kept out
by the _rn intrinsics).  Needs cupy and a visible CUDA device; skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cuda_devices

cupy = pytest.importorskip("cupy")
pytestmark = pytest.mark.skipif(cuda_devices() == 0, reason="no CUDA device visible")

from cosmotrain.data.readers.transform import apply_transform, int16_log1p_table  # noqa: E402
from cosmotrain.kernels import activation, dropout, loss, pool3d  # noqa: E402
from cosmotrain.kernels.cuda import raw_ops  # noqa: E402
from cosmotrain.precision import bfloat16, narrow, widen  # noqa: E402
from cosmotrain.engine.optim import Adam  # noqa: E402

DTYPES = ["float32", "bfloat16"]


def _dtype(name: str) -> np.dtype:
    return bfloat16() if name == "bfloat16" else np.dtype(np.float32)


def _same(got, want: np.ndarray) -> None:
    got = cupy.asnumpy(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(widen(got), widen(want), strict=True)


def _cpu(fn, x: np.ndarray, *args, **kwargs):
    return fn(x, *args, **kwargs) if x.dtype == np.float32 else narrow(
        fn(widen(x), *args, **kwargs))


@pytest.mark.parametrize("name", DTYPES)
def test_gpu_input_epilogue_dropout_and_loss(name: str) -> None:
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 3000, size=(2, 8, 8, 8, 4)).astype(np.int16)
    nchw = np.ascontiguousarray(counts.transpose(0, 4, 1, 2, 3))
    got = raw_ops.input_transform(cupy.asarray(counts), _dtype(name), "log1p", True,
                                  cupy.asarray(int16_log1p_table()))
    _same(got, apply_transform(nchw, "log1p").astype(_dtype(name)))
    x = rng.normal(size=(2, 3, 8, 8, 8)).astype(_dtype(name))
    bias = rng.normal(size=3).astype(np.float32)
    want = _cpu(lambda v: activation.leaky_relu_forward(v + bias[:, None, None, None], 0.3,
                                                        inplace=False), x)
    _same(raw_ops.bias_leaky_relu(cupy.asarray(x), cupy.asarray(bias), 0.3), want)
    keep = dropout.dropout_keep_mask(x.shape, (2, 0, 8, 0, 0), (4, 3, 16, 8, 8), 0.3, 5, 6, 7)
    _same(raw_ops.dropout(cupy.asarray(x), (2, 0, 8, 0, 0), (4, 3, 16, 8, 8), 0.3,
                          int(dropout.stream_key(5, 6, 7))),
          dropout.dropout_forward(x, keep, 0.3))
    target = rng.normal(size=x.shape).astype(np.float32)
    total, flag = cupy.zeros(1), cupy.zeros(1, dtype=np.int32)
    grad = raw_ops.mse(cupy.asarray(x), cupy.asarray(target), 99, total, flag)
    _same(grad, loss.mse_backward(x, target, 99))
    assert float(total[0]) == pytest.approx(loss.mse_sum(x, target), rel=1e-12)
    assert int(flag[0]) == 0


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape, by_planes", [((2, 3, 16, 16, 16), False),
                                              ((1, 2, 9, 70, 66), True)])
def test_gpu_pooling_gives_the_cpu_bits(name: str, shape, by_planes: bool) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=shape).astype(_dtype(name))
    pool = pool3d.PoolGeometry(shape, 3, 2, 1, by_planes=by_planes)
    _same(raw_ops.avg_pool_forward(cupy.asarray(x), pool),
          _cpu(pool3d.avg_pool3d_forward, x, 3, 2, 1, by_planes=by_planes))
    dy = rng.normal(size=pool.y_shape).astype(x.dtype)
    ya = rng.normal(size=shape).astype(x.dtype)
    fused = _cpu(lambda g: activation.leaky_relu_backward(
        pool3d.avg_pool3d_backward(g, shape, 3, 2, 1), widen(ya), 0.1), dy)
    _same(raw_ops.avg_pool_backward(cupy.asarray(dy), pool3d.PoolGeometry(shape, 3, 2, 1),
                                    cupy.asarray(ya), 0.1), fused)
    y, arg = raw_ops.max_pool2_forward(cupy.asarray(x))
    want_y, want_arg = pool3d.max_pool3d_forward(widen(x), 2, 2, 0)
    _same(y, want_y.astype(x.dtype))
    np.testing.assert_array_equal(cupy.asnumpy(arg), want_arg)


def test_gpu_adam_multi_gives_the_cpu_bits_and_skips_on_the_flag() -> None:
    rng = np.random.default_rng(3)
    data = [rng.normal(size=n).astype(np.float32) for n in (7, 1000, 33)]
    grad = [rng.normal(size=a.size).astype(np.float32) for a in data]
    ours = [cupy.asarray(a) for a in data]
    state = [[cupy.zeros_like(a) for a in ours] for _ in range(2)]
    table = raw_ops.tensor_table([ours, [cupy.asarray(g) for g in grad], *state],
                                 lambda a: a.data.ptr, cupy)
    skip = cupy.zeros(1, dtype=np.int32)
    optimizer = Adam(lr=0.01)
    for step in (1, 2):
        for i, (d, g) in enumerate(zip(data, grad)):
            optimizer.update(str(i), d, g, 0.01)
        raw_ops.multi_update("adam_multi", table,
                             cupy.asarray(raw_ops.adam_hyper(0.9, 0.999, 1e-8, 0.01, step)), skip)
    for got, want in zip(ours, data):
        _same(got, want)
    skip[0] = 1
    raw_ops.multi_update("adam_multi", table, cupy.asarray(raw_ops.adam_hyper(
        0.9, 0.999, 1e-8, 0.01, 3)), skip)
    for got, want in zip(ours, data):
        _same(got, want)


@pytest.mark.parametrize("name", DTYPES)
def test_gpu_direct_conv_gives_the_host_builds_bits(name: str) -> None:
    """conv_direct.cu on the device (its barrier real, its fmaf the hardware's) gives the
    bits of its host build (tests/test_conv1_device.py checks those against the CPU
    convolution), forward and weight gradient, for both conv1s: 16 filters with the
    LeakyReLU, 32 with a bias."""
    from cuda_host import HostLauncher, need_compiler

    need_compiler()
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 4, 9, 10, 11)).astype(_dtype(name))
    for filters, bias, slope in ((16, None, 0.01), (32, rng.normal(size=32), None)):
        w = rng.normal(size=(filters, 4, 3, 3, 3)).astype(_dtype(name))
        bias = None if bias is None else bias.astype(np.float32)
        want = raw_ops.conv_direct_forward(x, w, 1, bias, slope, launch=HostLauncher())
        got = raw_ops.conv_direct_forward(cupy.asarray(x), cupy.asarray(w), 1,
                                          None if bias is None else cupy.asarray(bias), slope)
        _same(got, want)
        dy = rng.normal(size=want.shape).astype(_dtype(name))
        _same(raw_ops.conv_direct_weight_grad(cupy.asarray(x), cupy.asarray(dy), w.shape, 1),
              raw_ops.conv_direct_weight_grad(x, dy, w.shape, 1, launch=HostLauncher()))
