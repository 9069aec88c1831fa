"""The 3D ResNet's training step on the stand-in GPU (tests/standin.py): batch norm
takes our kernels (kernels/cuda/src/batchnorm.cu) and the step makes the host wait for
nothing.  The engine's real step runs through tests/test_gpu_step_counts.py's
``training`` helper, the ResNet added to its table of networks here.

What it pins (docs/GPU.md, "What the CPU verifies"):

* every batch-norm layer's forward and backward are three launches of ours each way
  (the per-channel sums, the normalisation, the backward's sums and apply) on the
  activations' storage dtype, and none of the fused cupy batch-norm kernels runs;
* no host read inside a steady-state step (the count of the batch statistics stays on
  the device: ``kernels.batchnorm.bn_count``), one deferred read per step, and the same
  launches and allocations in two steady steps;
* the CPU path's losses to float32 rounding (fp32), and bf16's within its tolerance;
* the front doors of kernels/batchnorm.py on the stand-in against the CPU path: the
  applies' bits (bf16 too: both round the same float32 value once), the sums to float64
  rounding, the count kept on the device, ``xhat`` not written in evaluation, and a
  strided view kept off our storage-dtype kernels (float32: the fused kernels, which
  take strides; bf16: widened into a contiguous copy first, as before).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import test_gpu_step_counts as counts
from standin import installed

from cosmotrain.device.xp import to_host
from cosmotrain.kernels import batchnorm as bn
from cosmotrain.nn.module import Context
from cosmotrain.precision import bfloat16, widen

# A ResNet-10 with batch norm after every convolution, at the smallest width it takes.
RESNET = ["model.name=resnet3d", "model.depth=10", "model.width=16", "model.base_channels=4",
          "model.batchnorm=true"]
FUSED_BN = ("cosmotrain_sum_squares", "cosmotrain_sum_products", "cosmotrain_bn_forward",
            "cosmotrain_bn_backward")


@pytest.fixture
def resnet(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(counts.NETWORKS, "resnet", RESNET)
    return "resnet"


def batch_norms(network: str) -> int:
    cfg = counts.config(network)
    return sum(1 for name, _ in _serial_model(cfg).named_parameters()
               if name.endswith("weight") and ("bn" in name or "downsample.1" in name))


def _serial_model(cfg: Any) -> Any:
    from cosmotrain.models import build_model

    return build_model(cfg.model, seed=0)


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_resnet_step_runs_batch_norm_on_our_kernels_without_a_host_read(
        resnet: str, precision: str, rtol: float, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi4py import MPI

    extra = [f"device.precision={precision}"]
    ledgers, reads, losses = counts.counted_steps(MPI.COMM_SELF, monkeypatch, resnet, extra)
    counts.check_steady_state(ledgers)
    assert reads == [["asnumpy"]] * counts.STEPS  # the loss and votes, after the step
    suffix = "bf16" if precision == "bf16" else "f32"
    launched = Counter(launch.kernel for launch in ledgers[-1].launches)
    layers = batch_norms(resnet)
    assert layers >= 10
    # forward: the sums, then the statistics, running statistics and normalisation in
    # one launch; backward: the sums and the apply
    assert launched[f"channel_sums_{suffix}"] == 2 * layers
    assert launched[f"bn_train_forward_{suffix}"] == layers
    assert launched[f"bn_backward_apply_{suffix}"] == layers
    assert not set(FUSED_BN) & set(launched), launched
    # the activations are read as stored: no widening of a batch-sized 5-D block (but
    # the global average pool's (N, C, 1, 1, 1) output, cast for the dense head)
    batch_shape = counts.batch(resnet)[0].shape
    casts = [(launch.signature[0][0], launch.signature[2][0][1])
             for launch in ledgers[-1].launches if launch.kernel == "astype"]
    assert not [(shape, dtype, out) for (shape, dtype), out in casts
                if len(shape) == 5 and shape[0] == batch_shape[0] and dtype != out
                and shape != batch_shape and shape[2:] != (1, 1, 1)]
    np.testing.assert_allclose(losses, counts.cpu_losses(resnet, extra), rtol=rtol)
    print(precision, counts.trace_report(ledgers))


def front_door_results(xp: Any, x: np.ndarray, dy: np.ndarray, gamma: np.ndarray,
                       beta: np.ndarray) -> list[Any]:
    """A batch-norm layer's kernels in training order on ``xp``'s copies of the values:
    sums, normalisation (with and without ``xhat``), backward sums, input gradient."""
    put = (lambda a: a) if xp is np else xp.asarray
    x, dy, gamma, beta = (put(a) for a in (x, dy, gamma, beta))
    sums = bn.bn_local_sums(x)
    count = bn.bn_count(sums)
    mean, var = bn.bn_statistics(sums)
    y, xhat, inv_std = bn.bn_normalize(x, mean, var, gamma, beta, 1e-5)
    y_eval, no_xhat, _ = bn.bn_normalize(x, mean, var, gamma, beta, 1e-5, keep_xhat=False)
    back = bn.bn_backward_local_sums(dy, xhat)
    dx = bn.bn_backward_apply(dy, xhat, gamma, inv_std, back, count)
    return [sums, y, xhat, y_eval, no_xhat, back, dx, count]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_norm_front_doors_on_the_device_route(dtype: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    storage = bfloat16() if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(5)
    shape = (2, 3, 4, 5, 6)
    x = (rng.normal(size=shape) * 2 + 1).astype(np.float32).astype(storage)
    dy = rng.normal(size=shape).astype(np.float32).astype(storage)
    gamma, beta = (rng.normal(size=3).astype(np.float32) for _ in range(2))
    host = front_door_results(np, x, dy, gamma, beta)
    with installed(monkeypatch) as cupy:
        cupy.ledger.take()
        device = front_door_results(cupy, x, dy, gamma, beta)
        ledger = cupy.ledger.take()
        assert isinstance(device[-1], cupy.ndarray) and not ledger.syncs  # count stays
        with ledger.paused():
            device = [None if a is None else to_host(a) for a in device]
        strided = cupy.asarray(np.repeat(x, 2, axis=2))[:, :, ::2]  # x, not contiguous
        cupy.ledger.take()
        fallback = to_host(bn.bn_local_sums(strided))
        launched = {launch.kernel for launch in cupy.ledger.take().launches}
    if dtype == "float32":  # a strided view: the fused kernels, which take strides
        assert "cosmotrain_sum_squares" in launched and "channel_sums_f32" not in launched
    else:  # bf16 widened first (a contiguous float32 copy), then ours
        assert {"astype", "channel_sums_f32"} <= launched and "channel_sums_bf16" not in launched
    np.testing.assert_allclose(fallback[:2], host[0][:2], rtol=1e-12)
    kernels = [launch.kernel for launch in ledger.launches]
    suffix = "bf16" if dtype == "bfloat16" else "f32"
    assert kernels.count(f"channel_sums_{suffix}") == 2
    assert kernels.count(f"bn_forward_{suffix}") == 2
    assert kernels.count(f"bn_backward_apply_{suffix}") == 1
    sums, y, xhat, y_eval, no_xhat, back, dx, count = device
    assert no_xhat is None and float(count) == host[-1]
    np.testing.assert_allclose(sums, host[0], rtol=1e-14)
    np.testing.assert_allclose(back, host[5], rtol=1e-13, atol=1e-13)
    for got, want in ((y, host[1]), (xhat, host[2]), (y_eval, host[3]), (dx, host[6])):
        assert got.dtype == storage
        np.testing.assert_array_equal(widen(got), widen(want), strict=True)


def test_running_statistics_on_the_device_are_the_cpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The distributed layer's training forward on the stand-in device, in one launch
    (``bn_train_forward``) and on the step-by-step route it keeps for strided inputs,
    against the CPU layer: the output and the running statistics bit for bit, after a
    batch and after an empty one (``bn_statistics: local`` can leave a sample group
    without a sample: count 0, the running statistics kept), with no host read."""
    from cosmotrain.layers.batchnorm import dist_batchnorm
    from cosmotrain.nn.factory import batchnorm as serial_batchnorm
    from cosmotrain.runtime.timers import PhaseTimers

    rng = np.random.default_rng(8)
    batches = [(rng.normal(size=(2, 3, 4, 3, 5)) * 1.5 + 0.5).astype(np.float32),
               np.zeros((0, 3, 4, 3, 5), np.float32)]

    def layer() -> Any:
        made = dist_batchnorm(serial_batchnorm("bn", 3), None, PhaseTimers(), False)
        made.params["weight"].data[:] = [0.5, 1.5, -1.0]
        return made

    cpu = layer()
    want = []
    for x in batches:
        y = cpu.forward(x, Context())
        want.append((y, {k: np.array(v) for k, v in cpu.buffers.items()}))
    with installed(monkeypatch) as cupy:
        for strided in (False, True):
            device = layer()
            device.buffers = {k: cupy.asarray(v) for k, v in device.buffers.items()}
            device.params = {k: type(p)(cupy.asarray(p.data)) for k, p in device.params.items()}
            for x, (y, buffers) in zip(batches, want):
                block = cupy.asarray(np.repeat(x, 2, axis=2))[:, :, ::2] if strided \
                    else cupy.asarray(x)
                cupy.ledger.take()
                got = device.forward(block, Context())
                ledger = cupy.ledger.take()
                assert not ledger.syncs
                fused = any(launch.kernel == "bn_train_forward_f32"
                            for launch in ledger.launches)
                assert fused == (not strided or x.size == 0)  # an empty view is contiguous
                with cupy.ledger.paused():
                    np.testing.assert_array_equal(to_host(got), y, strict=True)
                    for key, value in buffers.items():
                        np.testing.assert_array_equal(to_host(device.buffers[key]), value,
                                                      err_msg=f"{key}, strided {strided}")


def test_resnet_step_captures_as_one_graph_with_our_batch_norm(
        resnet: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ResNet's step, batch norm on our kernels, captured as one CUDA graph on the
    stand-in (tests/test_cuda_graph.py's runner; its capture refuses host waits,
    pageable copies and cuBLAS) trains as the same job run eagerly, bit for bit, each
    step its own batch; its running statistics, updated in place, too."""
    import test_cuda_graph as graphs

    batches = graphs.varied(counts.batch(resnet), graphs.STEPS)
    eager = graphs.run(monkeypatch, "eager", batches, network=resnet)
    graphed = graphs.run(monkeypatch, "true", batches, network=resnet)
    assert eager["captures"] == 0 and graphed["captures"] == 1
    graphs.assert_same_training(eager, graphed)
    replays = graphed["ledgers"][graphs.WARMUP + 1:]
    assert all(len(ledger.graphs) == 1 and not ledger.syncs for ledger in replays)
