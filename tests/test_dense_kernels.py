"""The dense head's own CUDA kernels (kernels/cuda/src/linear.cu) run on the CPU through
the host build of their source (tests/cuda_host.py), on the heads' shapes at W = 128.

References: numpy in float64, and the CPU linear kernels (kernels/linear.py on numpy).
The kernels add in their own order (chunks of the inner dimension, then the chunks'
partial sums, then the bias; see linear.cu), cuBLAS and OpenBLAS in theirs, so sums of
float32 products agree within float32 summation error: at most ``terms`` roundings of
``sum |a_k b_k|`` (unit roundoff 2^-24), where ``terms`` is the longest chain of
roundings an output passes through (the chunk's adds, the partial sums' adds, the bias,
the products).  On integer values every order is exact, so the results must equal the
float64 reference bit for bit: that checks every index without a tolerance.  One
sample's weight gradient (one product per element) and the bias gradient (the samples
added in order, as numpy's sum over axis 0 does) are the CPU's bits.  bf16: operands
read as stored, one rounding to bf16 of the float32 result.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cuda_host import HostLauncher, need_compiler

from cosmotrain.kernels import linear
from cosmotrain.kernels.cuda import raw_linear
from cosmotrain.precision import bfloat16, narrow, widen

pytestmark = pytest.mark.usefixtures("compiler")
U32, U16 = 2.0 ** -24, 2.0 ** -8  # unit roundoffs of float32 and bf16

# (samples, inputs, outputs): the paper network's fc1 (batch 1), fc2 (batch 9: a full
# and a partial tile of 8 samples), fc3 (batch 32); MLPerf's fc1 (batch 3); an inner
# dimension short enough for one launch; odd sizes; an empty block (a rank's 0 samples);
# no inputs (MLPerf's head below W = 32: y = b, an empty data gradient).
SHAPES = [(1, 2048, 2048), (9, 2048, 256), (32, 256, 4), (3, 32768, 128), (4, 40, 30),
          (5, 70, 9), (0, 16, 8), (2, 0, 3)]


@pytest.fixture
def compiler() -> None:
    need_compiler()


def operands(shape: tuple[int, int, int], dtype: Any, integers: bool = False,
             seed: int = 0) -> tuple[np.ndarray, ...]:
    """x (N, I), weight (O, I), bias (O,), dy (N, O) in ``dtype``."""
    samples, inputs, outputs = shape
    rng = np.random.default_rng(seed)
    sizes = [(samples, inputs), (outputs, inputs), (outputs,), (samples, outputs)]
    if integers:
        return tuple(rng.integers(-3, 4, size=s).astype(dtype) for s in sizes)
    return tuple(rng.normal(size=s).astype(np.float32).astype(dtype) for s in sizes)


def terms(inner: int, outputs: int, samples: int) -> int:
    """Roundings an output of :func:`raw_linear.forward` passes through, at most."""
    chunk = raw_linear.chunk_for(inner, outputs, samples)
    return chunk + raw_linear.splits_for(inner, chunk) + 1


def within(got: np.ndarray, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    excess = np.abs(got.astype(np.float64) - want) - bound
    assert not excess.size or excess.max() <= 0, (what, float(excess.max()))


def run(dtype: Any, shape: tuple, integers: bool = False) -> dict[str, Any]:
    """The three kernels on one set of operands, and the launches they made."""
    x, w, b, dy = operands(shape, dtype, integers)
    launcher = HostLauncher()
    y = raw_linear.forward(x, w, b, launch=launcher)
    dx = raw_linear.backward_data(dy, w, launch=launcher)
    dw, db = raw_linear.backward_weight(x, dy, launch=launcher)
    return {"operands": (x, w, b, dy), "y": y, "dx": dx, "dw": dw, "db": db,
            "launches": [kernel for kernel, _ in launcher.launches]}


def references(x: Any, w: Any, b: Any, dy: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """name -> (float64 value, float64 sum of the absolute terms), from the stored values."""
    x, w, b, dy = (widen(v).astype(np.float64) for v in (x, w, b, dy))
    return {"y": (x @ w.T + b, np.abs(x) @ np.abs(w).T + np.abs(b)),
            "dx": (dy @ w, np.abs(dy) @ np.abs(w)),
            "dw": (dy.T @ x, np.abs(dy).T @ np.abs(x))}


def bounds(shape: tuple) -> dict[str, int]:
    samples, inputs, outputs = shape
    return {"y": terms(inputs, outputs, samples), "dx": terms(outputs, inputs, samples),
            "dw": samples + 1}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_float32_kernels_against_float64_and_the_cpu(shape: tuple) -> None:
    got = run(np.float32, shape)
    x, w, b, dy = got["operands"]
    chains = bounds(shape)
    for name, (want, absolute) in references(x, w, b, dy).items():
        within(got[name], want, chains[name] * U32 * absolute, name)
    # the CPU path (OpenBLAS: up to K roundings of its own): both within their bounds
    cpu_dw, cpu_db = linear.linear_backward_weight(x, dy)
    cpu = {"y": linear.linear_forward(x, w, b), "dx": linear.linear_backward_data(dy, w),
           "dw": cpu_dw}
    inner = {"y": shape[1], "dx": shape[2], "dw": shape[0]}
    for name, (_, absolute) in references(x, w, b, dy).items():
        assert got[name].dtype == cpu[name].dtype == np.float32, name
        within(got[name], cpu[name].astype(np.float64),
               (chains[name] + inner[name] + 1) * U32 * absolute, f"{name} against the CPU")
    np.testing.assert_array_equal(got["db"], cpu_db, strict=True)  # the samples in order
    if shape[0] == 1:  # one product per weight: the CPU's outer product, bit for bit
        np.testing.assert_array_equal(got["dw"], cpu_dw, strict=True)


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[4]], ids=str)
def test_integer_values_give_the_exact_result_in_any_order(shape: tuple, name: str) -> None:
    """Every partial sum is an integer below 2^24: exact in float32, so the results are
    the float64 reference's (bf16: its one rounding), whatever the order or the grid."""
    dtype = bfloat16() if name == "bfloat16" else np.dtype(np.float32)
    got = run(dtype, shape, integers=True)
    for key, (want, _) in references(*got["operands"]).items():
        stored = np.float32 if key == "dw" else dtype
        np.testing.assert_array_equal(got[key], want.astype(np.float32).astype(stored),
                                      strict=True, err_msg=key)
    np.testing.assert_array_equal(got["db"], widen(got["operands"][3]).sum(axis=0),
                                  strict=True)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[5]], ids=str)
def test_bf16_kernels_round_once_and_keep_a_float32_weight_gradient(shape: tuple) -> None:
    """bf16 storage: within one bf16 rounding of the exact result (plus the float32
    summation error before it), and within one bf16 step of the CPU bf16 path (which
    widens, multiplies in float32 and rounds once); dW and db float32 (products of two
    bf16 values are exact in float32, so only the sum rounds)."""
    dtype = bfloat16()
    got = run(dtype, shape)
    x, w, b, dy = got["operands"]
    chains = bounds(shape)
    cpu = {"y": linear.linear_forward(x, w, b), "dx": linear.linear_backward_data(dy, w)}
    for name, (want, absolute) in references(x, w, b, dy).items():
        summed = chains[name] * U32 * absolute
        if name == "dw":
            assert got[name].dtype == np.float32
            within(got[name], want, summed, name)
            continue
        assert got[name].dtype == dtype == cpu[name].dtype, name
        within(widen(got[name]), want, U16 * (np.abs(want) + summed) + summed, name)
        np.testing.assert_allclose(widen(got[name]), widen(cpu[name]), rtol=2.0 ** -7,
                                   atol=4 * float(summed.max(initial=0)), err_msg=name)
    cpu_dw, cpu_db = linear.linear_backward_weight(x, dy)
    np.testing.assert_array_equal(got["db"], cpu_db, strict=True)
    if shape[0] == 1:
        np.testing.assert_array_equal(got["dw"], cpu_dw, strict=True)


def test_launch_counts_and_the_split() -> None:
    """One launch per pass where one thread per output and sample tile fills the device
    (or the inner dimension is short), two where it is split; the weight gradient one."""
    assert run(np.float32, (4, 40, 30))["launches"] == [
        "linear_partial_f32", "linear_partial_f32", "linear_wgrad_f32"]
    assert run(np.float32, (1, 2048, 2048))["launches"] == [
        "linear_partial_f32", "linear_reduce_f32", "linear_partial_f32", "linear_reduce_f32",
        "linear_wgrad_f32"]
    # the heads at W = 128: MLPerf's fc1 at batch 1 splits its 32,768 terms in 512
    assert raw_linear.chunk_for(32768, 128, 1) == 64
    assert raw_linear.splits_for(32768, 64) == 512
    # its data gradient at batch 32 (32,768 outputs x 4 tiles) fills the device unsplit
    assert raw_linear.chunk_for(128, 32768, 32) == 128


def test_any_grid_gives_the_same_bits_and_no_bias_no_db() -> None:
    x, w, _, dy = operands((10, 150, 7), np.float32, seed=3)
    one = raw_linear.forward(x, w, None, launch=HostLauncher(grid=1, block=1))
    many = raw_linear.forward(x, w, None, launch=HostLauncher(grid=5, block=7))
    np.testing.assert_array_equal(one, many, strict=True)
    within(one, x.astype(np.float64) @ w.T.astype(np.float64),
           terms(150, 7, 10) * U32 * (np.abs(x) @ np.abs(w).T), "no bias")
    dw, db = raw_linear.backward_weight(x, dy, bias=False, launch=HostLauncher())
    assert db is None
    np.testing.assert_array_equal(
        dw, raw_linear.backward_weight(x, dy, launch=HostLauncher(grid=2, block=3))[0],
        strict=True)


def test_the_faces_refuse_mixed_dtypes_and_strided_operands() -> None:
    x, w, b, _ = operands((2, 6, 3), np.float32)
    with pytest.raises(ValueError, match="weight is bfloat16"):
        raw_linear.forward(x, narrow(w), b, launch=HostLauncher())
    with pytest.raises(ValueError, match="C-contiguous"):
        raw_linear.forward(np.asfortranarray(x), w, b, launch=HostLauncher())
    with pytest.raises(ValueError, match="against weight"):
        raw_linear.forward(x, w[:, :5].copy(), b, launch=HostLauncher())
    with pytest.raises(ValueError, match="gradient is bfloat16"):
        raw_linear.backward_weight(x, narrow(x[:, :3]), launch=HostLauncher())
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        raw_linear.forward(x.astype(np.float64), w.astype(np.float64), None,
                           launch=HostLauncher())
