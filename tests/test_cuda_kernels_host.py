"""Our CUDA kernels' own sources (kernels/cuda/src/*.cu) run on the CPU, through their
Python faces (kernels/cuda/raw_ops.py), against the project's CPU kernels: bit for bit
in float32, and in bf16 storage the CPU bf16 path's bits (it widens, computes in float32
and rounds once, as the kernels do).  The one exception is the MSE loss's float64 sum
(another summation order: to float64 rounding).  See tests/cuda_host.py."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_host import HostLauncher, need_compiler

from cosmotrain.data.readers.transform import apply_transform, int16_log1p_table
from cosmotrain.kernels import activation, dropout, loss, pool3d
from cosmotrain.kernels.cuda import pool as pool3d_xp
from cosmotrain.kernels.pool_activation import avg_pool_leaky_backward
from cosmotrain.kernels.cuda import raw_ops
from cosmotrain.precision import bfloat16, narrow, widen
from cosmotrain.engine.optim import SGD, Adam

pytestmark = pytest.mark.usefixtures("compiler")
DTYPES = ["float32", "bfloat16"]


@pytest.fixture
def compiler() -> None:
    need_compiler()


def _dtype(name: str) -> np.dtype:
    return bfloat16() if name == "bfloat16" else np.dtype(np.float32)


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bits (NaN payloads aside), dtype and shape."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(widen(got), widen(want), strict=True)


def _cpu(fn, x: np.ndarray, *args, **kwargs):
    """The CPU kernel on storage ``x``: float32 as is, bf16 widened and rounded back."""
    if x.dtype == np.float32:
        return fn(x, *args, **kwargs)
    return narrow(fn(widen(x), *args, **kwargs))


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("transform", ["log1p", "mean", "none"])
def test_input_transform_matches_the_readers(name: str, transform: str) -> None:
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 3000, size=(2, 5, 6, 3, 4)).astype(np.int16)  # NDHWC
    counts[0, 0, 0, 0] = [0, 1, 32767, 7]
    means = np.asarray([3.5, 0.0])  # an all-zero sample's divisor is 1
    divisor = np.where(means > 0, means, 1.0).astype(np.float32)
    nchw = np.ascontiguousarray(counts.transpose(0, 4, 1, 2, 3))
    want = apply_transform(nchw, transform, means).astype(_dtype(name))
    table = int16_log1p_table()
    for layout, source in ((True, counts), (False, nchw)):
        got = raw_ops.input_transform(source, _dtype(name), transform, layout, table, divisor,
                                      launch=HostLauncher())
        _same(got, want)


@pytest.mark.parametrize("name", DTYPES)
def test_bias_leaky_relu_and_its_backward(name: str) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 4, 5, 6)).astype(_dtype(name))
    bias = rng.normal(size=3).astype(np.float32)
    slope = 0.3
    want = _cpu(lambda v: activation.leaky_relu_forward(v + bias[:, None, None, None], slope,
                                                        inplace=False), x)
    got = raw_ops.bias_leaky_relu(x, bias, slope, launch=HostLauncher())
    _same(got, want)
    if name == "bfloat16":  # the layers' unfused path rounds the bias and the sum too
        bias16 = widen(bias.astype(x.dtype))[:, None, None, None]
        unfused = narrow(activation.leaky_relu_forward(widen(narrow(widen(x) + bias16)), slope))
        np.testing.assert_allclose(widen(got), widen(unfused), rtol=2 ** -6, atol=2 ** -7)
    _same(raw_ops.bias_leaky_relu(x, None, slope, launch=HostLauncher()),
          _cpu(lambda v: activation.leaky_relu_forward(v, slope, inplace=False), x))
    inplace = x.copy()
    assert raw_ops.bias_leaky_relu(inplace, bias, slope, out=inplace,
                                   launch=HostLauncher()) is inplace
    _same(inplace, want)
    dy = rng.normal(size=x.shape).astype(x.dtype)
    back = _cpu(lambda g: activation.leaky_relu_backward(g, widen(want), slope,
                                                         inplace=False), dy)
    _same(raw_ops.leaky_relu_backward(dy, want, slope, launch=HostLauncher()), back)


# (input shape, kernel, stride, padding): CosmoFlow's k3 s2 p1 on the CPU's whole-volume
# path, on its plane-by-plane path (over WHOLE_BYTES a channel), and two other windows.
POOLS = [((2, 3, 7, 8, 9), 3, 2, 1, False), ((1, 1, 66, 64, 64), 3, 2, 1, False),
         ((1, 2, 9, 6, 8), 3, 2, 1, True), ((2, 2, 6, 5, 7), 2, 2, 0, False),
         ((1, 2, 5, 6, 4), 3, 1, ((1, 0), (1, 1), (0, 1)), False)]


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape, kernel, stride, padding, by_planes", POOLS)
def test_avg_pool_forward_and_fused_backward_give_the_cpu_bits(
        name: str, shape, kernel, stride, padding, by_planes: bool) -> None:
    if name == "bfloat16" and shape[2] == 66:
        pytest.skip("the large volume is covered in float32; bf16 shares its order")
    rng = np.random.default_rng(3)
    x = rng.normal(size=shape).astype(_dtype(name))
    pool = pool3d.PoolGeometry(shape, kernel, stride, padding, by_planes=by_planes)
    want = _cpu(pool3d.avg_pool3d_forward, x, kernel, stride, padding, by_planes=by_planes)
    _same(raw_ops.avg_pool_forward(x, pool, launch=HostLauncher()), want)
    dy = rng.normal(size=want.shape).astype(x.dtype)
    back = pool  # by_planes is the forward's choice; the backward keeps the CPU's order
    want_dx = _cpu(pool3d.avg_pool3d_backward, dy, shape, kernel, stride, padding)
    _same(raw_ops.avg_pool_backward(dy, back, launch=HostLauncher()), want_dx)
    ya = rng.normal(size=shape).astype(x.dtype)
    fused = _cpu(lambda g: activation.leaky_relu_backward(
        pool3d.avg_pool3d_backward(g, shape, kernel, stride, padding), widen(ya), 0.1), dy)
    _same(raw_ops.avg_pool_backward(dy, back, ya, 0.1, launch=HostLauncher()), fused)


@pytest.mark.parametrize("name", DTYPES)
def test_max_pool2_ties_nans_and_odd_sizes(name: str) -> None:
    rng = np.random.default_rng(4)
    shape = (2, 3, 5, 7, 6)
    x = rng.integers(-2, 3, size=shape).astype(_dtype(name))  # many ties
    x[0, 0, 0, 0, 1] = x[1, 2, 3, 3, 5] = np.nan
    x[0, 1, 2, 2, 2] = -np.inf
    want_y, want_arg = _cpu(lambda v: pool3d.max_pool3d_forward(v, 2, 2, 0)[0], x), \
        pool3d.max_pool3d_forward(widen(x), 2, 2, 0)[1]
    y, arg = raw_ops.max_pool2_forward(x, launch=HostLauncher())
    _same(y, want_y)
    np.testing.assert_array_equal(arg, want_arg, strict=True)
    dy = rng.normal(size=y.shape).astype(x.dtype)
    dy.reshape(-1)[5] = np.inf
    want_dx = _cpu(pool3d.max_pool3d_backward, dy, want_arg, shape, 2, 2, 0)
    _same(raw_ops.max_pool2_backward(dy, arg, shape, launch=HostLauncher()), want_dx)


def test_xp_average_pooling_takes_the_kernels_with_the_cpu_bits() -> None:
    """kernels/cuda/pool.py sends float32 and bf16 device arrays to avgpool.cu: the CPU
    kernels' bits (its own whole-array path adds in another order); float64 stays."""
    x = np.random.default_rng(13).normal(size=(2, 3, 7, 6, 9)).astype(np.float32)
    pool = pool3d.PoolGeometry(x.shape, 3, 2, 1)
    launcher = HostLauncher()
    y = pool3d_xp.avg_pool3d_forward(x, pool, launch=launcher)
    _same(y, pool3d.avg_pool3d_forward(x, 3, 2, 1))
    dy = np.random.default_rng(14).normal(size=y.shape).astype(np.float32)
    _same(pool3d_xp.avg_pool3d_backward(dy, pool, launch=launcher),
          pool3d.avg_pool3d_backward(dy, x.shape, 3, 2, 1))
    assert [k for k, _ in launcher.launches] == ["avgpool_forward_f32", "avgpool_backward_f32"]
    pool3d_xp.avg_pool3d_forward(x.astype(np.float64), pool, launch=launcher)
    assert len(launcher.launches) == 2


@pytest.mark.parametrize("name", DTYPES)
def test_the_layers_fused_pooling_backward_takes_the_kernel(name: str) -> None:
    """kernels/pool_activation.py (act -> pool backward) on the device: the CPU's bits
    in float32, a strided activation (a halo buffer's owned planes) included; in bf16
    within bf16 rounding of the CPU's two passes (one rounding, not two)."""
    rng = np.random.default_rng(15)
    wide = rng.normal(size=(2, 3, 6, 7, 12)).astype(_dtype(name))
    y = wide[..., 2:10]
    dy = rng.normal(size=(2, 3, 3, 4, 4)).astype(y.dtype)
    launcher = HostLauncher()
    got = avg_pool_leaky_backward(dy, y, 0.2, 3, 2, 1, launch=launcher)
    want = avg_pool_leaky_backward(dy, np.ascontiguousarray(y), 0.2, 3, 2, 1)
    assert launcher.launches and launcher.launches[0][0].startswith("avgpool_backward")
    if name == "float32":
        _same(got, want)
    else:
        np.testing.assert_allclose(widen(got), widen(want), rtol=2 ** -6, atol=1e-6)


def test_xp_max_pooling_takes_the_kernel_for_tiled_windows_only() -> None:
    """kernels/cuda/pool.py (the GPU's pooling) routes 2x2x2 tiled windows to
    maxpool.cu: the same results as its whole-array path, and no host wait."""
    x = np.random.default_rng(11).integers(-3, 3, size=(2, 2, 6, 4, 5)).astype(np.float32)
    x[1, 1, 2, 2, 2] = np.nan
    pool = pool3d.PoolGeometry(x.shape, 2, 2, 0, max_pool=True)
    launcher = HostLauncher()
    y, arg = pool3d_xp.max_pool3d_forward(x, pool, launch=launcher)
    want_y, want_arg = pool3d_xp.max_pool3d_forward(x, pool)
    _same(y, want_y)
    np.testing.assert_array_equal(arg, want_arg, strict=True)
    dy = np.random.default_rng(12).normal(size=y.shape).astype(np.float32)
    _same(pool3d_xp.max_pool3d_backward(dy, arg, pool, launch=launcher),
          pool3d_xp.max_pool3d_backward(dy, arg, pool))
    assert [k for k, _ in launcher.launches] == ["maxpool2_forward_f32", "maxpool2_backward_f32"]
    overlapping = pool3d.PoolGeometry(x.shape, 3, 2, 1, max_pool=True)
    pool3d_xp.max_pool3d_forward(x, overlapping, launch=launcher)
    assert len(launcher.launches) == 2


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("local, offset, total", [
    ((2, 3, 4, 5, 6), (1, 0, 4, 0, 2), (4, 3, 8, 5, 9)), ((3, 7), (2, 0), (8, 7))])
def test_dropout_draws_the_cpu_mask_on_any_block(name: str, local, offset, total) -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=local).astype(_dtype(name))
    p, seed, step, salt = 0.3, 1234, 17, 2
    keep = dropout.dropout_keep_mask(local, offset, total, p, seed, step, salt)
    assert 0 < keep.mean() < 1
    got = raw_ops.dropout(x, offset, total, p, seed, salt, np.asarray([float(step)]),
                          launch=HostLauncher())
    _same(got, dropout.dropout_forward(x, keep, p))


@pytest.mark.parametrize("name", DTYPES)
def test_mse_gradient_sum_and_finiteness_flag(name: str) -> None:
    rng = np.random.default_rng(6)
    pred = rng.normal(size=(4, 4)).astype(_dtype(name))
    target = rng.normal(size=(4, 4)).astype(np.float32)
    total, flag = np.zeros(1), np.zeros(1, dtype=np.int32)
    grad = raw_ops.mse(pred, target, 40, total, flag, launch=HostLauncher())
    _same(grad, loss.mse_backward(pred, target, 40))
    assert total[0] == pytest.approx(loss.mse_sum(pred, target), rel=1e-13)
    assert flag[0] == 0
    pred[1, 2] = np.nan
    raw_ops.mse(pred, target, 40, total, flag, launch=HostLauncher())
    assert flag[0] == 1


def _tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=n).astype(np.float32) for n in (5, 1, 170, 901)]


@pytest.mark.parametrize("decay", [0.0, 0.05])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_multi_tensor_optimizers_give_torch_optims_bits_and_skip_on_the_flag(
        kind: str, decay: float) -> None:
    data, ours = _tensors(7), _tensors(7)
    states = [[np.zeros_like(a) for a in ours] for _ in range(1 if kind == "sgd" else 2)]
    grads = [_tensors(8), _tensors(9)]
    optimizer = (SGD(lr=0.1, momentum=0.9, weight_decay=decay) if kind == "sgd"
                 else Adam(lr=0.01, weight_decay=decay))
    table = raw_ops.tensor_table([ours, grads[0], *states], lambda a: a.ctypes.data)
    assert all(any(a is b for b in table.arrays) for a in [*ours, *grads[0]])  # kept alive
    skip = np.zeros(1, dtype=np.int32)
    for step, grad in enumerate(grads, start=1):
        for i, (d, g) in enumerate(zip(data, grad)):
            optimizer.apply(str(i), d, g, 0.1 if kind == "sgd" else 0.01)
        for target, g in zip(grads[0], grad):  # the table holds grads[0]'s addresses
            target[...] = g
        hyper = (raw_ops.sgd_hyper(0.9, 0.1, step == 1, decay) if kind == "sgd"
                 else raw_ops.adam_hyper(0.9, 0.999, 1e-8, 0.01, step, decay))
        raw_ops.multi_update(f"{kind if kind == 'adam' else 'sgd_momentum'}_multi", table,
                             hyper, skip, launch=HostLauncher())
    for want, got in zip(data, ours):
        _same(got, want)
    skip[0] = 1
    before = [a.copy() for a in ours]
    raw_ops.multi_update("adam_multi" if kind == "adam" else "sgd_momentum_multi", table,
                         hyper, skip, launch=HostLauncher())
    for want, got in zip(before, ours):
        _same(got, want)


def test_nonfinite_flag_and_any_grid() -> None:
    x = np.arange(50, dtype=np.float32)
    flag = np.zeros(1, dtype=np.int32)
    raw_ops.nonfinite_flag(x, flag, launch=HostLauncher())
    assert flag[0] == 0
    x[37] = np.inf
    raw_ops.nonfinite_flag(x, flag, launch=HostLauncher(grid=2, block=3))
    assert flag[0] == 1
    # one thread or several: a grid-stride loop computes the same
    pool = pool3d.PoolGeometry((1, 2, 7, 6, 5), 3, 2, 1)
    v = np.random.default_rng(10).normal(size=pool.x_shape).astype(np.float32)
    _same(raw_ops.avg_pool_forward(v, pool, launch=HostLauncher(grid=1, block=1)),
          raw_ops.avg_pool_forward(v, pool, launch=HostLauncher(grid=5, block=7)))



def test_dropout_reads_the_step_from_device_memory_with_any_seed() -> None:
    """The kernel works the stream key out from the step count it reads (a float64 in
    device memory) as ``dropout.stream_key`` does, for a seed past 2^63 too; a new step
    written into the same memory draws that step's mask (a replayed graph's case)."""
    x = np.random.default_rng(8).normal(size=(2, 3, 4, 4, 4)).astype(np.float32)
    step = np.zeros(1)
    shape = x.shape
    for seed, at in ((2**64 - 5, 3), (7, 40)):
        step[0] = at
        got = raw_ops.dropout(x, (0,) * 5, shape, 0.4, seed, 11, step,
                              launch=HostLauncher())
        keep = dropout.dropout_keep_mask(shape, (0,) * 5, shape, 0.4, seed, at, 11)
        _same(got, dropout.dropout_forward(x, keep, 0.4))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_put_values_writes_the_arguments_into_device_memory(dtype) -> None:
    target = np.full(10, -1.0, dtype=dtype)
    raw_ops.put_values(target, [1.5, 2.0, 3.25], launch=HostLauncher())
    np.testing.assert_array_equal(target, [1.5, 2.0, 3.25] + [-1.0] * 7)
    raw_ops.put_values(target, list(range(8)), launch=HostLauncher())
    np.testing.assert_array_equal(target[:8], np.arange(8))
    with pytest.raises(ValueError, match="up to 8"):
        raw_ops.put_values(target, list(range(9)))
