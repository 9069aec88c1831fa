"""conv1's kernels on the CPU (issue 35 item 5; tests/test_conv1_wiring.py has them in the
engine, on the stand-in cupy).

* ``src/conv_direct.cu`` (its host build, tests/cuda_host.py, phase by phase across its
  one barrier) against the CPU convolution (kernels/conv3d.py) and a float64 reference:
  float32 within float32 summation error (it sums in its own order, with fmaf), bf16
  within one bf16 rounding of the exact result; bias and LeakyReLU fused.
* Its weight gradient (partial sums per chunk of output rows, then their sums, in
  launches of their own) against the CPU's, float32 within summation error, bf16
  within one rounding.
* The channel padding (``conv1_channels_pad``) on the gemm path: the same outputs and
  weight gradients as unpadded, the padded weight kept in one persistent buffer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from cuda_host import HostLauncher, need_compiler

from cosmotrain.kernels import conv3d
from cosmotrain.kernels.cuda import conv as cuda_conv, conv1, raw, raw_ops
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.kernels.geometry import ConvGeometry
from cosmotrain.precision import bfloat16, widen

EPS32 = 2.0 ** -24
GEMM = ConvSettings(algorithm="gemm")
# (x shape, w shape, padding): conv1 of both networks (small), 8 channels, a filter count
# that leaves a partial group of 16, asymmetric padding, another kernel size
CASES = [((2, 4, 6, 5, 7), (16, 4, 3, 3, 3), 1),
         ((1, 4, 5, 6, 4), (32, 4, 3, 3, 3), 1),
         ((1, 8, 4, 5, 6), (20, 8, 3, 3, 3), ((1, 0), (0, 1), (2, 1))),
         ((2, 3, 5, 4, 6), (5, 3, 2, 3, 1), ((0, 1), (1, 1), (0, 0)))]


def exact(x: np.ndarray, w: np.ndarray, padding: Any, bias: Any, slope: Any
          ) -> tuple[np.ndarray, np.ndarray]:
    """(float64 result, float64 bound of float32 summation error) of the fused forward."""
    x64, w64 = widen(x).astype(np.float64), widen(w).astype(np.float64)
    y = conv3d.conv3d_forward(x64, w64, 1, padding)
    terms = conv3d.conv3d_forward(np.abs(x64), np.abs(w64), 1, padding)
    if bias is not None:
        y, terms = y + bias.reshape(1, -1, 1, 1, 1), terms + np.abs(bias).reshape(1, -1, 1, 1, 1)
    rows = ConvGeometry.create(x.shape, w.shape, 1, padding).rows
    if slope is not None:
        y = np.maximum(y, slope * y)
    return y, (rows + 2) * EPS32 * terms


def values(shape: tuple, seed: int, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_direct_kernel_matches_the_cpu_convolution(case: int, name: str) -> None:
    need_compiler()
    dtype = bfloat16() if name == "bfloat16" else np.dtype(np.float32)
    x_shape, w_shape, padding = CASES[case]
    x, w = values(x_shape, 1, dtype), values(w_shape, 2, dtype)
    bias, slope = (values(w_shape[:1], 3), 0.3) if case % 2 == 0 else (None, None)
    got = raw_ops.conv_direct_forward(x, w, padding, bias, slope, launch=HostLauncher())
    want, error = exact(x, w, padding, bias, slope)
    assert got.dtype == dtype and got.shape == want.shape
    if name == "float32":
        assert np.all(np.abs(got - want) <= error)
        cpu = conv3d.conv3d_forward(x, w, 1, padding, bias=bias, activation=slope)
        np.testing.assert_allclose(got, cpu, rtol=0, atol=2 * float(error.max()))
    else:  # one rounding of the float32 sum (half a bf16 unit: 2^-8 relative), its error
        assert np.all(np.abs(widen(got) - want) <= 2.0 ** -8 * np.abs(want) + 2 * error)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads, fan", [(raw_ops.WGRAD_THREADS, 64),
                                          (raw_ops.WGRAD_THREADS, 4), (7, 64)])
def test_direct_weight_gradient_matches_the_cpus(case: int, name: str, threads: int,
                                                 fan: int, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """The weight gradient's launches against the CPU's and a float64 reference:
    float32 within float32 summation error over every output voxel, bf16 (dw in bf16)
    within one rounding of that; in chunks of one output row (the many threads asked
    for at these sizes), whose partial sums one reduction adds, or (``fan`` 4) several
    in turn; and in one chunk."""
    need_compiler()
    monkeypatch.setattr(raw_ops, "WGRAD_THREADS", threads)
    monkeypatch.setattr(raw_ops, "REDUCE_FAN", fan)
    dtype = bfloat16() if name == "bfloat16" else np.dtype(np.float32)
    x_shape, w_shape, padding = CASES[case]
    x = values(x_shape, 1, dtype)
    geo = ConvGeometry.create(x_shape, w_shape, 1, padding)
    dy = values(geo.y_shape, 5, dtype)
    launcher = HostLauncher()
    got = raw_ops.conv_direct_weight_grad(x, dy, w_shape, padding, launch=launcher)
    x64, dy64 = widen(x).astype(np.float64), widen(dy).astype(np.float64)
    want = conv3d.conv3d_backward_filter(x64, dy64, w_shape, 1, padding)
    terms = conv3d.conv3d_backward_filter(np.abs(x64), np.abs(dy64), w_shape, 1, padding)
    error = (np.prod(geo.y_shape) // geo.filters + 2) * EPS32 * terms
    assert got.dtype == dtype and got.shape == tuple(w_shape)
    chunks = math.prod(geo.y_shape[:1] + geo.out[:2]) if threads > 7 else 1
    levels = 0
    while chunks > fan:  # the float32 reductions before the last
        chunks, levels = -(-chunks // fan), levels + 1
    assert [kernel for kernel, _ in launcher.launches] == [
        f"conv_direct_wgrad_{raw.suffix(dtype)}", *["conv_direct_wgrad_reduce_f32"] * levels,
        f"conv_direct_wgrad_reduce_{raw.suffix(dtype)}"]
    if name == "float32":
        assert np.all(np.abs(got - want) <= error)
        cpu = conv3d.conv3d_backward_filter(x, dy, w_shape, 1, padding)
        np.testing.assert_allclose(got, cpu, rtol=0, atol=2 * float(error.max()))
    else:
        assert np.all(np.abs(widen(got) - want) <= 2.0 ** -8 * np.abs(want) + 2 * error)


def test_direct_kernel_refuses_weights_beyond_its_shared_memory() -> None:
    x = np.zeros((1, 8, 4, 4, 4), np.float32)
    with pytest.raises(ValueError, match="at most 6912 weights"):
        raw_ops.conv_direct_forward(x, np.zeros((33, 8, 3, 3, 3), np.float32), 1)
    direct = ConvSettings(conv1_algorithm="direct")
    assert conv1.takes_direct(x, (32, 8, 3, 3, 3), 1, direct)
    for w_shape, stride, settings in (((33, 8, 3, 3, 3), 1, "direct"),
                                      ((16, 8, 3, 3, 3), 2, "direct"),
                                      ((16, 8, 3, 3, 3), 1, "default")):
        assert not conv1.takes_direct(x, w_shape, stride,
                                      ConvSettings(conv1_algorithm=settings))
    assert not conv1.takes_direct(np.zeros((1, 9, 4, 4, 4)), (16, 9, 3, 3, 3), 1, direct)
    assert not conv1.takes_direct_wgrad(x, (16, 8, 3, 3, 3), 1, direct)  # numpy: no launch
    with pytest.raises(ValueError, match="up to 3 wide"):
        raw_ops.conv_direct_weight_grad(x, np.zeros((1, 16, 4, 4, 2), np.float32),
                                        (16, 8, 3, 3, 5), 1)


@pytest.mark.parametrize("pad", [8, 16, 3])
def test_padded_channels_give_the_same_forward_and_weight_gradient(pad: int) -> None:
    x, w = values((2, 4, 6, 5, 7), 1), values((16, 4, 3, 3, 3), 2)
    dy = values((2, 16, 6, 5, 7), 3)
    padded = ConvSettings(algorithm="gemm", conv1_channels_pad=pad)
    conv1._PADDED_WEIGHTS.clear()
    y = cuda_conv.conv3d_forward(x, w, 1, 1, settings=padded)
    dw = cuda_conv.conv3d_backward_filter(x, dy, w.shape, 1, 1, settings=padded)
    np.testing.assert_allclose(y, cuda_conv.conv3d_forward(x, w, 1, 1, settings=GEMM),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, cuda_conv.conv3d_backward_filter(x, dy, w.shape, 1, 1,
                                                                    settings=GEMM),
                               rtol=1e-5, atol=1e-5)
    assert dw.shape == w.shape and dw.flags.c_contiguous
    (buffer,) = conv1._PADDED_WEIGHTS.values()  # one persistent padded weight
    assert buffer.shape == (16, conv1.padded_channels(4, pad), 3, 3, 3)
    assert not buffer[:, 4:].any() and np.array_equal(buffer[:, :4], w)
    w2 = values(w.shape, 4)
    cuda_conv.conv3d_forward(x, w2, 1, 1, settings=padded)
    assert list(conv1._PADDED_WEIGHTS.values()) == [buffer]  # reused: the new weights in it
    assert np.array_equal(buffer[:, :4], w2)
    dx = cuda_conv.conv3d_backward_data(dy, w, x.shape, 1, 1, settings=padded)
    assert dx.shape == x.shape  # never padded


def test_padding_leaves_multiples_alone() -> None:
    assert [conv1.padded_channels(c, 8) for c in (4, 8, 9, 16)] == [8, 8, 16, 16]
    assert conv1.padded_channels(4, 0) == 4
    called = []
    settings = ConvSettings(conv1_channels_pad=8)
    assert conv1.run_padded("conv3d_forward", (np.zeros((1, 16, 2, 2, 2)), None), (), settings,
                            lambda *a: called.append(a)) is None
    assert conv1.run_padded("conv3d_backward_data", (np.zeros((1, 4, 2, 2, 2)), None), (),
                            settings, lambda *a: called.append(a)) is None
    assert not called
