"""Batch norm's CUDA source (kernels/cuda/src/batchnorm.cu) run on the CPU through its
faces (kernels/cuda/raw_bn.py) and the host build (tests/cuda_host.py: blocks of
threads run concurrently, so the shared-memory reduction's barriers are real), against
the CPU batch-norm kernels (kernels/batchnorm.py on numpy): the float64 sums to float64
rounding (another adding order), the applies bit for bit, in float32 and in bf16
storage (the CPU bf16 path widens, computes in float32 and rounds once, as the kernels
do).  Where cupy sees a CUDA device the same checks run a second time on it, the
kernels compiled by NVRTC and launched through cupy (``benchmarks/gpu_check.sh``'s
``tests`` stage); elsewhere that case is skipped."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cuda_devices
from cuda_host import HostLauncher, need_compiler

from cosmotrain.kernels import batchnorm
from cosmotrain.kernels.cuda import raw_bn
from cosmotrain.precision import bfloat16, narrow, widen

DTYPES = ["float32", "bfloat16"]
# A ResNet block's shape, an odd one (voxels not a multiple of any grid) and no sample.
SHAPES = [(2, 3, 4, 5, 6), (3, 5, 7, 1, 3), (0, 2, 3, 3, 3)]
# Grids: the default, one block, and blocks of a size that is not a power of two.
GRIDS = [(3, 4), (1, 1), (2, 3)]


class Host:
    """The host build: numpy arrays, a small grid of ``grid`` (blocks, threads)."""

    def __init__(self, grid: tuple[int, int] = (3, 4)) -> None:
        need_compiler()
        self.grid = grid

    def launch(self) -> HostLauncher:
        return HostLauncher(*self.grid)

    @staticmethod
    def put(a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def get(a: np.ndarray) -> np.ndarray:
        return a


class Device(Host):
    """The device: cupy arrays, the kernels' own launch (the grid is cupy_launch's)."""

    def __init__(self, grid: tuple[int, int] = (3, 4)) -> None:
        if cuda_devices() == 0:
            pytest.skip("no CUDA device visible")
        import cupy
        self.cupy, self.grid = cupy, grid

    def launch(self) -> None:
        return None

    def put(self, a: np.ndarray) -> object:  # type: ignore[override]
        return self.cupy.asarray(a)

    def get(self, a: object) -> np.ndarray:  # type: ignore[override]
        return self.cupy.asnumpy(a)


@pytest.fixture(params=[Host, Device], ids=["host", "device"])
def where(request: pytest.FixtureRequest) -> type[Host]:
    return request.param


def _values(name: str, shape: tuple, seed: int, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=shape) + shift).astype(np.float32)
    return x.astype(bfloat16()) if name == "bfloat16" else x


def _same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(widen(got), widen(want), strict=True)


def _float64_close(got: np.ndarray, want: np.ndarray, terms: int) -> None:
    """Two float64 sums of ``terms`` exact terms in different orders."""
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * terms * np.finfo(np.float64).eps
                               * max(scale, 1.0))


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("grid", GRIDS)
def test_channel_sums_are_the_cpus_to_float64_rounding(
        name: str, shape: tuple, grid: tuple, where: type[Host],
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = where(grid)
    if isinstance(run, Device) and grid != GRIDS[0]:
        pytest.skip("the device's grid is cupy_launch's: one run suffices")
    x, dy = _values(name, shape, 1, shift=3.0), _values(name, shape, 2)
    terms = shape[0] * int(np.prod(shape[2:]))
    for slices in (1, 2):  # one block per channel, and each channel over two blocks
        monkeypatch.setattr(raw_bn, "slices_for", lambda *_, s=slices: s)
        got = run.get(raw_bn.channel_sums(run.put(x), count=True, launch=run.launch()))
        want = batchnorm.bn_local_sums(x)
        assert got.shape == want.shape == (3, shape[1]) and got.dtype == np.float64
        _float64_close(got, want, terms)
        np.testing.assert_array_equal(got[2], want[2])
        xhat = batchnorm.bn_normalize(x, *batchnorm.bn_statistics(want),
                                      np.ones(shape[1], np.float32),
                                      np.zeros(shape[1], np.float32), 1e-5)[1]
        got = run.get(raw_bn.channel_sums(run.put(dy), run.put(xhat), launch=run.launch()))
        _float64_close(got, batchnorm.bn_backward_local_sums(dy, xhat), terms)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_normalize_and_backward_apply_are_the_cpus_bits(name: str, shape: tuple,
                                                         where: type[Host]) -> None:
    run, channels = where(), shape[1]
    rng = np.random.default_rng(3)
    x, dy = _values(name, shape, 4, shift=-1.5), _values(name, shape, 5)
    gamma = rng.normal(size=channels).astype(np.float32)
    beta = rng.normal(size=channels).astype(np.float32)
    mean, var = batchnorm.bn_statistics(batchnorm.bn_local_sums(x))
    y, xhat, inv_std = batchnorm.bn_normalize(x, mean, var, gamma, beta, 1e-5)
    put = run.put
    got_y, got_xhat = raw_bn.bn_forward(put(x), put(mean), put(inv_std), put(gamma), put(beta),
                                        launch=run.launch())
    _same(run.get(got_y), y)
    _same(run.get(got_xhat), xhat)
    alone, none = raw_bn.bn_forward(put(x), put(mean), put(inv_std), put(gamma), put(beta),
                                    keep_xhat=False, launch=run.launch())
    assert none is None
    _same(run.get(alone), y)
    sums = batchnorm.bn_backward_local_sums(dy, xhat)
    count = batchnorm.bn_count(batchnorm.bn_local_sums(x))
    want = batchnorm.bn_backward_apply(dy, xhat, gamma, inv_std, sums, count)
    got = raw_bn.bn_backward_apply(put(dy), put(xhat), put(sums), put(np.asarray(count, np.float64)),
                                   put(gamma), put(inv_std), launch=run.launch())
    _same(run.get(got), want)
    empty = batchnorm.bn_backward_apply(dy, xhat, gamma, inv_std, sums, 0.0)  # n = 1
    got = raw_bn.bn_backward_apply(put(dy), put(xhat), put(sums), put(np.asarray(0.0)),
                                   put(gamma), put(inv_std), launch=run.launch())
    _same(run.get(got), empty)
    if name == "bfloat16":  # the one rounding: of the float32 result, as stored
        wide = batchnorm.bn_normalize(widen(x), mean, var, gamma, beta, 1e-5)[0]
        _same(run.get(got_y), narrow(wide))


def _cpu_running(running: np.ndarray, value: np.ndarray, momentum: float) -> np.ndarray:
    """nn.layers.BatchNorm3d's rule on a float32 buffer."""
    return ((1 - momentum) * running + momentum * value).astype(np.float32)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_train_forward_is_the_cpus_statistics_running_update_and_normalisation(
        name: str, shape: tuple, where: type[Host]) -> None:
    """``bn_train_forward`` against the CPU's three steps: ``bn_statistics``, the running
    statistics' rule (the unbiased variance, momentum 0.1) and ``bn_normalize``, bit for
    bit; with ``guard`` a count of 0 (no sample) leaves the running statistics, without
    it they take the rule (mean and variance 0)."""
    run, channels = where(), shape[1]
    rng = np.random.default_rng(6)
    x = _values(name, shape, 7, shift=0.75)
    gamma = rng.normal(size=channels).astype(np.float32)
    beta = rng.normal(size=channels).astype(np.float32)
    sums = batchnorm.bn_local_sums(x)
    mean, var = batchnorm.bn_statistics(sums)
    y, xhat, inv_std = batchnorm.bn_normalize(x, mean, var, gamma, beta, 1e-5)
    count = batchnorm.bn_count(sums)
    for guard in (True, False):
        running = [rng.normal(size=channels).astype(np.float32),
                   rng.uniform(0.5, 2, size=channels).astype(np.float32)]
        if count > 0 or not guard:
            want = [_cpu_running(running[0], mean, 0.1),
                    _cpu_running(running[1], var * batchnorm.bn_unbiased_factor(count), 0.1)]
        else:
            want = [a.copy() for a in running]
        device = [run.put(a.copy()) for a in running]
        got = raw_bn.bn_train_forward(run.put(x), run.put(sums), run.put(gamma), run.put(beta),
                                      *device, 1e-5, 0.1, guard, launch=run.launch())
        for g, w in zip(got, (y, xhat, inv_std)):
            _same(run.get(g), w)
        for g, w in zip(device, want):
            _same(run.get(g), w)


def test_slices_fill_the_device_and_keep_work_per_thread() -> None:
    # the paper ResNet's stem at W = 128, batch 8: 16 channels, 64 blocks each
    assert raw_bn.slices_for(8, 16, 128 ** 3) == raw_bn.TARGET_BLOCKS // 16
    assert raw_bn.slices_for(1, 2, 256) == 1  # one block-wide row of voxels
    assert raw_bn.slices_for(0, 4, 8) == 1
    # a deep stage (256 channels at 8^3, batch 1): at least 32 elements per thread
    assert raw_bn.slices_for(1, 256, 512) == 1
