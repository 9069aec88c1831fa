"""The dense head on our own kernels (``ConvSettings.dense == "kernels"``), on the
stand-in cupy of tests/standin.py: the front doors of kernels/linear.py launch
``linear.cu`` (run by its host build) and no ``matmul``, bf16 read as stored; and a
training step of the networks runs its dense layers without a single matmul, with the
same steady trace every step (what a CUDA graph captures) and the CPU path's losses.
The kernels' arithmetic against float64 is tests/test_dense_kernels.py's."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import test_gpu_step_counts as counts
from standin import installed
from test_dense_kernels import U32, operands, references, terms

from cosmotrain.device.xp import to_host
from cosmotrain.kernels import linear
from cosmotrain.kernels.cuda.settings import ConvSettings
from cosmotrain.precision import widen

BF16 = np.dtype(ml_dtypes.bfloat16)
KERNELS = ConvSettings(dense="kernels")
SHAPE = (3, 300, 20)  # samples, inputs, outputs: the forward splits its 300 terms


def passes(x: Any, w: Any, b: Any, dy: Any, settings: Any) -> dict[str, Any]:
    dw, db = linear.linear_backward_weight(x, dy, settings=settings)
    return {"y": linear.linear_forward(x, w, b, settings=settings),
            "dx": linear.linear_backward_data(dy, w, settings=settings), "dw": dw, "db": db}


def on_standin(dtype: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[dict[str, np.ndarray], list[str]]:
    """The three passes on the stand-in device: results on the host, kernels launched."""
    host = operands(SHAPE, dtype, seed=4)
    with installed(monkeypatch) as cupy:
        device = [cupy.asarray(a) for a in host]
        cupy.ledger.take()
        out = passes(*device, settings)
        taken = cupy.ledger.take()
        assert not taken.syncs, taken.sync_sites  # nothing read back, no wait
        launched = [launch.kernel for launch in taken.launches]
        return {k: to_host(v) for k, v in out.items()}, launched


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_the_front_doors_launch_our_kernels_and_no_matmul(
        dtype: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dense: kernels``: forward (split in two launches), data gradient, weight and bias
    gradient (one launch), nothing else but the results' allocations: no matmul, no
    widening or narrowing of a bf16 operand; the CPU path's values within float32
    summation error (bf16: one rounding).  The default settings keep cuBLAS's matmul."""
    got, launched = on_standin(dtype, KERNELS, monkeypatch)
    kind = "bf16" if dtype == BF16 else "f32"
    assert [k for k in launched if k not in ("empty",)] == [
        f"linear_wgrad_{kind}", f"linear_partial_{kind}", f"linear_reduce_{kind}",
        f"linear_partial_{kind}"], launched
    host = operands(SHAPE, dtype, seed=4)
    cpu = passes(*host, None)
    chains = {"y": terms(SHAPE[1], SHAPE[2], SHAPE[0]) + SHAPE[1] + 1,
              "dx": terms(SHAPE[2], SHAPE[1], SHAPE[0]) + SHAPE[2] + 1, "dw": 2 * SHAPE[0] + 2}
    for name, (_, absolute) in references(*host).items():
        assert got[name].dtype == cpu[name].dtype, name
        summed = chains[name] * U32 * absolute
        rounding = 2.0 ** -7 * np.abs(widen(cpu[name])) if got[name].dtype == BF16 else 0
        excess = np.abs(widen(got[name]) - widen(cpu[name])) - summed - rounding
        assert excess.max() <= 0, (name, float(excess.max()))
    np.testing.assert_array_equal(got["db"], cpu["db"], strict=True)
    _, default = on_standin(dtype, None, monkeypatch)
    assert default.count("matmul") == 3 and not any(k.startswith("linear_") for k in default)


def test_dense_is_a_checked_setting() -> None:
    assert ConvSettings().dense == "cublas"
    with pytest.raises(ValueError, match="ConvSettings.dense must be one of cublas, kernels"):
        ConvSettings(dense="cudnn")


def dense_training(monkeypatch: pytest.MonkeyPatch, network: str, precision: str,
                   dense: str) -> tuple[Any, list, list[float]]:
    """tests/test_gpu_step_counts.py's stand-in steps, the runtime's settings with
    ``dense``: the step, each step's ledger, the losses."""
    from mpi4py import MPI

    real = counts.job_runtime

    def with_dense(*args: Any, **kwargs: Any) -> Any:
        runtime = real(*args, **kwargs)
        return replace(runtime, conv=replace(runtime.conv, dense=dense))
    monkeypatch.setattr(counts, "job_runtime", with_dense)
    try:
        step, ledgers, outs, _ = counts.training(
            MPI.COMM_SELF, monkeypatch, network, [f"device.precision={precision}"],
            [counts.batch(network)])
    finally:
        monkeypatch.setattr(counts, "job_runtime", real)
    return step, ledgers, [out.loss for out in outs]


def matmuls(ledger: Any) -> Counter:
    return Counter(launch.signature for launch in ledger.launches
                   if launch.kernel == "matmul")


@pytest.mark.parametrize("network, precision", [("cosmoflow", "fp32"), ("cosmoflow", "bf16"),
                                                ("mlperf", "fp32")])
def test_a_training_step_runs_its_dense_layers_without_matmul(
        network: str, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole step on the stand-in with the dense kernels: of the cuBLAS step's
    matmuls exactly the dense layers' (forward, weight and data gradient of each linear
    layer) are gone, the convolutions' (gemm on the stand-in) remain; our kernels run
    instead; two steady steps issue the same trace; no host read inside a step; in bf16
    no head activation is widened or narrowed; the losses are the cuBLAS step's to
    float32 rounding (fp32; the paper network's are also the CPU path's) or within a
    bf16 rounding (bf16)."""
    _, ledgers, losses = dense_training(monkeypatch, network, precision, "kernels")
    _, cublas_ledgers, cublas_losses = dense_training(monkeypatch, network, precision,
                                                      "cublas")
    ours, theirs = matmuls(ledgers[-1]), matmuls(cublas_ledgers[-1])
    assert ours <= theirs and ours != theirs
    gone = theirs - ours
    assert sum(gone.values()) == 9, gone  # 3 linear layers x 3 passes
    assert all(len(shape) == 2 for signature in gone for shape, _ in signature[0]), gone
    suffix = "bf16" if precision == "bf16" else "f32"
    launched = Counter(launch.kernel for launch in ledgers[-1].launches)
    assert launched[f"linear_wgrad_{suffix}"] == 3 and launched[f"linear_partial_{suffix}"] >= 6
    counts.check_steady_state(ledgers)
    if precision == "bf16":
        batch = counts.batch(network)[0].shape[0]
        casts = [launch.signature[0][0] for launch in ledgers[-1].launches
                 if launch.kernel == "astype" and len(launch.signature[0][0][0]) == 2
                 and launch.signature[0][0][0][0] == batch]
        assert not casts, casts  # the weights' casts (Parameter.like) are (out, in)
        np.testing.assert_allclose(losses, cublas_losses, rtol=2.0 ** -7)
    else:
        np.testing.assert_allclose(losses, cublas_losses, rtol=1e-5)
    if (network, precision) == ("cosmoflow", "fp32"):
        # the paper network's cuBLAS step is the CPU's bit for bit on the stand-in; the
        # MLPerf network's is not (3.8e-5 at step 3, max pooling's path, not the head's)
        np.testing.assert_allclose(losses, counts.cpu_losses(network), rtol=1e-5)
    print(network, precision, "dense kernels", counts.trace_report(ledgers),
          "cublas", counts.trace_report(cublas_ledgers))
