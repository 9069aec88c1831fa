"""The GPU path against the CPU path: kernels, whole training steps, ranks sharing a GPU.

Needs cupy and a visible CUDA device; skipped cleanly anywhere else (CI has neither).
The convolution kernels themselves are tested in ``tests/test_gpu_conv.py``; here they
are reached through the engine (``kernels/conv3d.py`` dispatches cupy arrays to them).

Tolerances (relative error norms; docs/GPU.md):

* fp32: element-wise kernels 1e-5 (pooling, activations, dropout, losses: the same
  arithmetic), reductions and GEMMs 1e-4 (another summation order); training steps:
  predictions, losses, every layer's gradient and the parameters after 3 steps 1e-4,
  the bound of the CPU's own layout-equivalence tests;
* tf32: 1e-2 on predictions, losses, the gradient as one vector and the parameters
  (TF32 keeps 10 mantissa bits: about 5e-4 per product);
* bf16: as the CPU emulation is held to (``tests/test_bf16.py``): cosmoflow at 32^3
  within 1e-2 of the CPU's float32 on predictions, losses, the gradient vector and the
  parameters; kernels within 1e-2 of float32.

Several ranks share the one GPU with spatial splits through host staging (the default
``communication``), in one 4-rank launch: D2H2 and N2D2 on all four ranks, D2 and W2 on
two pairs at once.  NCCL cannot bind two ranks to one GPU: its collectives are checked
on a 1-rank communicator (the calls, pointers and dtypes), and CUDA-aware MPI only when
``COSMOTRAIN_TEST_CUDA_AWARE=1`` says the MPI library is built for it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")


def _visible_devices() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no driver or no device: nothing to test
        return 0


pytestmark = pytest.mark.skipif(_visible_devices() == 0, reason="no CUDA device visible")

from conftest import abort_on_error  # noqa: E402
from equivalence import relative_error  # noqa: E402
from precision_runs import over, precision_errors, step_run  # noqa: E402

from cosmotrain.comm.transport import make_transport as DeviceBuffers  # noqa: E402
from cosmotrain.kernels import (activation, batchnorm, conv3d, dropout, linear, loss,  # noqa: E402
                                pool3d)
from cosmotrain.precision import bfloat16, widen  # noqa: E402

COSMOFLOW = ["model.name=cosmoflow", "model.width=32", "model.dropout=0.2"]
TINY_BN = ["model.name=tiny", "model.width=13", "model.batchnorm=true", "model.dropout=0.3"]
GPU = ["device.backend=gpu"]
PRECISION_BOUNDS = {"fp32": {"": 1e-4}, "tf32": {"": 1e-2}, "bf16": {"": 1e-2}}


def host(array) -> np.ndarray:
    return np.asarray(widen(cupy.asnumpy(array)) if isinstance(array, cupy.ndarray)
                      else widen(array), np.float64)


def close(got, want, rtol: float) -> None:
    err = relative_error(host(got), host(want))
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"


def on_gpu(array: np.ndarray, dtype=None):
    moved = cupy.asarray(array)
    return moved if dtype is None else moved.astype(dtype)


@pytest.mark.parametrize("dtype, rtol, gemm_rtol", [(np.float32, 1e-5, 1e-4),
                                                     ("bf16", 1e-2, 1e-2)])
def test_kernels_on_the_gpu_match_the_cpu(dtype, rtol, gemm_rtol) -> None:
    storage = bfloat16() if dtype == "bf16" else np.float32
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 9, 8, 7)).astype(np.float32)
    xg = on_gpu(x, storage)
    for args in ((3, 2, 1), (2, 2, 0), ((3, 2, 3), (1, 2, 3), ((1, 0), (0, 1), (2, 1)))):
        y = pool3d.avg_pool3d_forward(x, *args)
        close(pool3d.avg_pool3d_forward(xg, *args), y, rtol)
        dy = rng.normal(size=y.shape).astype(np.float32)
        close(pool3d.avg_pool3d_backward(on_gpu(dy, storage), x.shape, *args),
              pool3d.avg_pool3d_backward(dy, x.shape, *args), rtol)
    y, arg = pool3d.max_pool3d_forward(x, 2, 2, 0)
    yg, argg = pool3d.max_pool3d_forward(xg, 2, 2, 0)
    close(yg, y, rtol)
    dy = rng.normal(size=y.shape).astype(np.float32)
    close(pool3d.max_pool3d_backward(on_gpu(dy, storage), on_gpu(arg), x.shape, 2, 2, 0),
          pool3d.max_pool3d_backward(dy, arg, x.shape, 2, 2, 0), rtol)
    if dtype == np.float32:
        np.testing.assert_array_equal(cupy.asnumpy(argg), arg)
    close(activation.leaky_relu_forward(xg.copy(), 0.1),
          activation.leaky_relu_forward(x.copy(), 0.1), rtol)
    dy = rng.normal(size=x.shape).astype(np.float32)
    strided = on_gpu(np.pad(dy, ((0, 0), (0, 0), (1, 1), (0, 0), (0, 0))), storage)[:, :, 1:-1]
    close(activation.leaky_relu_backward(strided, xg, 0.1),
          activation.leaky_relu_backward(dy.copy(), x, 0.1), rtol)
    sums = batchnorm.bn_local_sums(x)
    close(batchnorm.bn_local_sums(xg), batchnorm.bn_local_sums(widen(host(xg))), gemm_rtol)
    mean, var = batchnorm.bn_statistics(sums)
    gamma, beta = rng.normal(size=3).astype(np.float32), rng.normal(size=3).astype(np.float32)
    yb, xhat, inv = batchnorm.bn_normalize(x, mean, var, gamma, beta, 1e-5)
    ybg, xhatg, invg = batchnorm.bn_normalize(xg, on_gpu(mean), on_gpu(var), on_gpu(gamma),
                                              on_gpu(beta), 1e-5)
    close(ybg, yb, rtol)
    back = batchnorm.bn_backward_local_sums(dy, xhat)
    close(batchnorm.bn_backward_local_sums(on_gpu(dy, storage), xhatg), back, gemm_rtol)
    close(batchnorm.bn_backward_apply(on_gpu(dy, storage), xhatg, on_gpu(gamma), invg,
                                      on_gpu(back), 2 * 9 * 8 * 7),
          batchnorm.bn_backward_apply(dy, xhat, gamma, inv, back, 2 * 9 * 8 * 7), rtol)
    keep = dropout.dropout_keep_mask(x.shape, (1, 0, 2, 0, 0), (4, 3, 12, 8, 7), 0.3, 5, 6, 7)
    keepg = dropout.dropout_keep_mask(x.shape, (1, 0, 2, 0, 0), (4, 3, 12, 8, 7), 0.3, 5, 6,
                                      7, cupy)
    np.testing.assert_array_equal(cupy.asnumpy(keepg), keep)
    close(dropout.dropout_forward(xg, keepg, 0.3), dropout.dropout_forward(x, keep, 0.3),
          rtol)
    a, w, b = (rng.normal(size=s).astype(np.float32) for s in ((5, 12), (4, 12), (4,)))
    close(linear.linear_forward(on_gpu(a, storage), on_gpu(w, storage), on_gpu(b, storage)),
          linear.linear_forward(a, w, b), gemm_rtol)
    t = rng.normal(size=(5, 4)).astype(np.float32)
    pred = linear.linear_forward(a, w, b)
    assert loss.mse_sum(on_gpu(pred, storage), on_gpu(t)) == pytest.approx(
        loss.mse_sum(pred, t), rel=gemm_rtol)
    close(loss.mse_backward(on_gpu(pred, storage), on_gpu(t), 20),
          loss.mse_backward(pred, t, 20), rtol)


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-4), ("tf32", 5e-3), ("bf16", 1e-2)])
def test_convolutions_through_the_engine(precision, rtol) -> None:
    from cosmotrain.kernels.cuda.settings import ConvSettings

    settings = ConvSettings(math="tf32" if precision == "tf32" else "fp32")
    storage = bfloat16() if precision == "bf16" else np.float32
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 4, 10, 9, 8)).astype(np.float32)
    w = rng.normal(size=(6, 4, 3, 3, 3)).astype(np.float32)
    pad = ((1, 0), (1, 1), (0, 1))
    y = conv3d.conv3d_forward(x, w, 1, pad)
    close(conv3d.conv3d_forward(on_gpu(x, storage), on_gpu(w, storage), 1, pad,
                                settings=settings), y, rtol)
    dy = rng.normal(size=y.shape).astype(np.float32)
    close(conv3d.conv3d_backward_data(on_gpu(dy, storage), on_gpu(w, storage), x.shape, 1, pad,
                                      settings=settings),
          conv3d.conv3d_backward_data(dy, w, x.shape, 1, pad), rtol)
    close(conv3d.conv3d_backward_filter(on_gpu(x, storage), on_gpu(dy, storage), w.shape, 1,
                                        pad, settings=settings),
          conv3d.conv3d_backward_filter(x, dy, w.shape, 1, pad), rtol)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_training_steps_on_one_gpu_match_the_cpu(precision) -> None:
    from mpi4py import MPI

    ref = step_run(MPI.COMM_SELF, COSMOFLOW)
    got = step_run(MPI.COMM_SELF, COSMOFLOW, [*GPU, f"device.precision={precision}"])
    found = over(precision_errors(got, ref), PRECISION_BOUNDS[precision])
    if precision == "fp32":
        found += [f"grad {name}" for name, grad in ref["grads"].items()
                  if not relative_error(got["grads"][name], grad) <= 1e-4]
    assert not found, found
    tiny = precision_errors(step_run(MPI.COMM_SELF, TINY_BN,
                                     [*GPU, f"device.precision={precision}"]),
                            step_run(MPI.COMM_SELF, TINY_BN))
    assert not over(first_step(tiny, precision), PRECISION_BOUNDS[precision]), tiny


def first_step(errors: dict[str, float], precision: str) -> dict[str, float]:
    """All errors in fp32; for tf32 and bf16 on tiny only the first step's predictions
    and loss: its gradients hinge on a few max-pool winners and LeakyReLU kinks that
    rounding flips (``tests/test_bf16.py``)."""
    if precision == "fp32":
        return errors
    return {key: value for key, value in errors.items() if key in ("pred", "loss0")}


@pytest.mark.parallel(nprocs=4)
@abort_on_error
def test_ranks_sharing_the_gpu_with_spatial_splits_match_the_cpu() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    refs = world.bcast({name: step_run(MPI.COMM_SELF, model) for name, model in
                        (("cosmoflow", COSMOFLOW), ("tiny-bn", TINY_BN))}
                       if world.rank == 0 else None, root=0)
    pair = world.Split(world.rank // 2, world.rank)
    cases = [(world, "D2H2", ["parallel.depth=2", "parallel.height=2"]),
             (world, "N2D2", ["parallel.sample=2", "parallel.depth=2"]),
             (pair, "D2" if world.rank < 2 else "W2",
              ["parallel.depth=2"] if world.rank < 2 else ["parallel.width=2"])]
    failures = []
    for comm, label, layout in cases:
        for precision in ("fp32", "tf32", "bf16"):
            bounds = PRECISION_BOUNDS[precision]
            for name, model in (("cosmoflow", COSMOFLOW), ("tiny-bn", TINY_BN)):
                got = step_run(comm, model, [*layout, *GPU, f"device.precision={precision}"])
                errors = precision_errors(got, refs[name])
                if name == "tiny-bn":
                    errors = first_step(errors, precision)
                failures += [f"{name} {label} {precision}: {f}" for f in over(errors, bounds)]
    pair.Free()
    failures = sorted(set(sum(world.allgather(failures), [])))
    assert not failures, failures


def test_nccl_collectives_on_one_rank() -> None:
    from mpi4py import MPI

    from cosmotrain.device.probe import nccl_loads as _nccl_loads

    if not _nccl_loads():
        pytest.skip("cupy.cuda.nccl does not load (pip install nvidia-nccl-cu12)")
    transport, comm = DeviceBuffers("nccl"), MPI.COMM_SELF
    values = cupy.arange(6, dtype=cupy.float32)
    transport.allreduce(comm, values)
    transport.wait([transport.iallreduce(comm, values)])
    out = cupy.zeros(6, cupy.float32)
    transport.allgatherv(comm, values, out, [6])
    transport.alltoallv(comm, values, [6], out, [6])
    transport.reduce_scatter(comm, values, out, [6])
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), np.arange(6))


@pytest.mark.skipif(os.environ.get("COSMOTRAIN_TEST_CUDA_AWARE") != "1",
                    reason="set COSMOTRAIN_TEST_CUDA_AWARE=1 where MPI is CUDA-aware")
@pytest.mark.parallel(nprocs=2)
@abort_on_error
def test_cuda_aware_mpi_matches_the_cpu() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ref = world.bcast(step_run(MPI.COMM_SELF, TINY_BN) if world.rank == 0 else None, root=0)
    got = step_run(world, TINY_BN, ["parallel.depth=2", *GPU,
                                    "device.communication=cuda-aware"])
    failures = over(precision_errors(got, ref), {"": 1e-4})
    assert not sorted(set(sum(world.allgather(failures), []))), failures


def test_training_cli_on_the_gpu(cli, tmp_path) -> None:
    from conftest import REPO

    code, out, err = cli("train", "--config", str(REPO / "configs" / "tiny.yaml"), "--set",
                         "backend=gpu", "--set", f"output.dir={tmp_path}")
    assert code == 0, err
    assert "device (rank 0): gpu" in out
    code, out, _ = cli("info", "--json")
    assert code == 0 and '"cuda devices": "0:' in out


@pytest.mark.parametrize("name, precision", [("log1p", "fp32"), ("mean", "bf16")])
def test_int16_input_stage_matches_the_host(name: str, precision: str) -> None:
    """engine/input_stage.py on cupy: pinned buffers, the copy stream and its events, and
    input.cu give the host transform's bits (rounded once to bf16 in bf16), batch after
    batch through both slots, with the compute stream never waited on by the host."""
    from cosmotrain.data.readers.transform import (DeviceTransform, apply_transform,
                                                    mean_divisors)
    from cosmotrain.engine.input_stage import device_stage
    from cosmotrain.precision import storage_dtype

    stage, dtype = device_stage(cupy), storage_dtype(precision)
    rng = np.random.default_rng(9)
    for _ in range(3):
        x = rng.poisson(2.0, size=(2, 4, 16, 16, 16)).astype(np.int16)
        means = x.reshape(2, -1).mean(axis=1)
        transform = DeviceTransform(name, mean_divisors(means) if name == "mean" else None)
        got = cupy.asnumpy(stage(x, transform, dtype))
        want = apply_transform(x, name, means if name == "mean" else None).astype(dtype)
        assert got.tobytes() == want.tobytes()
