"""What a GPU training step asks of the device and of the host, counted on the CPU.

The engine's real step (:class:`cosmotrain.engine.step.HybridStep`) runs on the GPU path
with the stand-in cupy of tests/standin.py: every host synchronisation, kernel launch
and allocation is recorded.  Step 0 is warm-up (first-use uploads, cached constants,
the optimizer's first slots); steps 1 and 2 are the steady state compared.  Both
networks at a small width (and the paper network in bf16) on one rank, and both on a
spatial layout (D2 on two ranks, staging transport); the paper network also on N2 with
the optimizer state sharded.

What these tests pin (docs/GPU.md, "What the CPU verifies"):

* no host read inside a steady-state step (``engine/device_verdict.py``), and one
  deferred read per step when the caller asks for the loss (``StepOutput.loss``);
  on a spatial layout the staging transport's stream synchronisations, the same number
  every step (MPI reads host copies: one per halo exchange batch, gradient bucket and
  the loss allreduce; NCCL, which the stand-in cannot run, needs none);
* the launch trace: two steady-state steps issue the same ordered launches (kernel,
  operand shapes and dtypes, scalar arguments) but for the launches that write the
  step's own values into device memory (the step count, the learning rate), and the
  same sequence of allocations.  Their buffer addresses are not all the same: cupy's
  pool (here numpy's heap) hands out what is free, and stable addresses need a step
  memory plan on the device (issue 35 item 4), reported, not asserted;
* a non-finite step is never applied on the device path either (its flags decide).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from conftest import abort_on_error
from standin import Ledger, installed
from standin_nccl import installed_nccl

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.load import load_config
from cosmotrain.device.select import Device
from cosmotrain.engine.step import HybridStep, hybrid_step_from_config, job_runtime
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor

NETWORKS = {"cosmoflow": ["model.name=cosmoflow", "model.width=16", "model.dropout=0.2"],
            "mlperf": ["model.name=cosmoflow-mlperf", "model.width=32",
                       "model.dropout=0.2"]}
COMMON = ["train.batch_size=2", "optimizer.name=sgd", "optimizer.lr=0.002",
          "optimizer.momentum=0.9", "device.conv_algorithm=gemm"]
D2 = ["parallel.depth=2", "parallel.sample=1"]
N2_SHARDED = ["parallel.sample=2", "parallel.shard_optimizer=true"]
STEPS = 3
# The launches that write each step's own values into device memory, outside a captured
# graph (engine/step_scalars.py): the only ones whose arguments change from step to step.
SCALAR_WRITES = {"put_f64x8", "put_f32x8"}
# The staging transport's one synchronisation per device message batch.
TRANSPORT_SYNC = "stream.synchronize"


def training(comm: Any, monkeypatch: pytest.MonkeyPatch, network: str, extra: list[str],
             batches: list[tuple[np.ndarray, np.ndarray]], steps: int = STEPS,
             communication: str = "staging"
             ) -> tuple[Any, list[Ledger], list[Any], list[list[str]]]:
    """``steps`` steps on the stand-in GPU, batch ``it % len(batches)`` at step ``it``:
    the step, each step's ledger, output and deferred reads (``out.loss``)."""
    cfg = config(network, extra)
    with installed(monkeypatch) as cupy:
        if communication == "nccl":
            installed_nccl(monkeypatch, cupy.ledger)
        grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
        device = Device("gpu", 0, cfg.device.precision, communication, "gemm")
        step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
        ledgers, outs, reads = [], [], []
        for it in range(steps):
            x, targets = batches[it % len(batches)]
            dist, coord = step.model.input_distribution(x.shape)
            block = DistTensor.scatter(x, dist, coord)
            cupy.ledger.take()
            out = step(block, targets, Context(step=it, seed=cfg.train.seed))
            ledgers.append(cupy.ledger.take())
            assert isinstance(out.pred, cupy.ndarray)  # nothing fell off the device
            _ = out.loss  # the one deferred read, after the step
            reads.append(cupy.ledger.take().syncs)
            outs.append(out)
        grid.free()
    return step, ledgers, outs, reads


def config(network: str, extra: list[str] = ()) -> Any:
    return load_config(None, [*NETWORKS[network], *COMMON, *extra])


def batch(network: str) -> tuple[np.ndarray, np.ndarray]:
    cfg = config(network)
    rng = np.random.default_rng(7)
    width, size = cfg.model.width, cfg.train.batch_size
    x = rng.normal(size=(size, cfg.model.channels, width, width, width)).astype(np.float32)
    return x, rng.normal(size=(size, cfg.model.outputs)).astype(np.float32)


def cpu_losses(network: str, extra: list[str] = ()) -> list[float]:
    """``STEPS`` steps of one batch on the CPU path: the losses a device step is held to."""
    from mpi4py import MPI

    cfg = config(network, extra)
    grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
    step = hybrid_step_from_config(cfg, grid)
    x, targets = batch(network)
    dist, coord = step.model.input_distribution(x.shape)
    losses = [step(DistTensor.scatter(x, dist, coord), targets,
                   Context(step=it, seed=cfg.train.seed)).loss for it in range(STEPS)]
    grid.free()
    return losses


def counted_steps(comm: Any, monkeypatch: pytest.MonkeyPatch, network: str,
                  extra: list[str] = (), communication: str = "staging"
                  ) -> tuple[list[Ledger], list[list[str]], list[float]]:
    """``STEPS`` steps of one batch: each step's ledger, deferred reads and loss."""
    _, ledgers, outs, reads = training(comm, monkeypatch, network, extra, [batch(network)],
                                       communication=communication)
    return ledgers, reads, [out.loss for out in outs]


def host_reads(ledger: Ledger) -> Counter:
    """Where the host waited for the device, but for the transport's synchronisations."""
    return Counter(site for why, site in zip(ledger.syncs, ledger.sync_sites)
                   if why != TRANSPORT_SYNC)


def check_steady_state(ledgers: list[Ledger]) -> None:
    """Host reads as today, the same launches and allocations in two steady steps."""
    first, second = ledgers[-2], ledgers[-1]
    assert host_reads(first) == host_reads(second) == Counter(), second.sync_sites
    assert second.launches, "the step launched nothing on the stand-in device"
    assert [a.kernel for a in first.launches] == [b.kernel for b in second.launches]
    differ = [a.kernel for a, b in zip(first.launches, second.launches)
              if a.signature != b.signature]
    assert set(differ) <= SCALAR_WRITES, differ  # the step count, the hyperparameters
    assert first.allocations == second.allocations
    assert first.uploads == second.uploads


def trace_report(ledgers: list[Ledger]) -> dict[str, Any]:
    first, second = ledgers[-2], ledgers[-1]
    return {"launches": len(second.launches), "allocations": len(second.allocations),
            "uploads": len(second.uploads), "host reads": dict(host_reads(second)),
            "transport syncs": second.syncs.count(TRANSPORT_SYNC),
            "same addresses": sum(a.addresses == b.addresses
                                  for a, b in zip(first.launches, second.launches))}


def check_own_kernels(ledger: Ledger, precision: str, batch_shape: tuple) -> None:
    """The layers' element-wise work runs our CUDA kernels (kernels/cuda/src) on the
    activations' storage dtype: the convolution epilogue, the activation's backward,
    dropout, the loss; and in bf16 no activation (5-D, the batch leading) is widened
    to float32 or narrowed back around them (the float32 batch's cast to bf16 on
    arrival, ``HybridStep.place_input``, is the input's: issue 35 item 1)."""
    suffix = "bf16" if precision == "bf16" else "f32"
    kernels = {launch.kernel for launch in ledger.launches}
    for name in ("bias_leaky_relu", "leaky_relu_backward", "dropout", "mse"):
        assert f"{name}_{suffix}" in kernels, (name, sorted(kernels))
    casts = [(launch.signature[0][0], launch.signature[2][0]) for launch in ledger.launches
             if launch.kernel == "astype"]  # ((shape, dtype) of the operand, of the result)
    widened = [(shape, dtype, out) for (shape, dtype), (_, out) in casts
               if len(shape) == 5 and shape[0] == batch_shape[0] and dtype != out
               and shape != batch_shape]
    assert not widened, widened


@pytest.mark.parametrize("network, precision", [("cosmoflow", "fp32"), ("mlperf", "fp32"),
                                                ("cosmoflow", "bf16"), ("mlperf", "bf16")])
def test_steady_state_step_on_one_rank(network: str, precision: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi4py import MPI

    ledgers, reads, _ = counted_steps(MPI.COMM_SELF, monkeypatch, network,
                                      [f"device.precision={precision}"])
    check_steady_state(ledgers)
    check_own_kernels(ledgers[-1], precision, batch(network)[0].shape)
    assert reads == [["asnumpy"]] * STEPS  # the loss and votes: one read each step
    assert not ledgers[-1].syncs.count(TRANSPORT_SYNC)  # one rank: nothing crosses MPI
    print(network, precision, trace_report(ledgers))


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_steady_state_step_on_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """D2 for both networks, and N2 with the optimizer state sharded (one update launch
    over the shard pieces, engine/optim_shards_device.py), staging transport: no host read in the step but the transport's
    stream synchronisations (MPI reads pinned host copies), the same number every step,
    and one deferred read."""
    from mpi4py import MPI

    for network, layout in [("cosmoflow", D2), ("mlperf", D2), ("cosmoflow", N2_SHARDED)]:
        ledgers, reads, _ = counted_steps(MPI.COMM_WORLD, monkeypatch, network, layout)
        check_steady_state(ledgers)
        assert reads == [["asnumpy"]] * STEPS
        syncs = [ledger.syncs.count(TRANSPORT_SYNC) for ledger in ledgers[1:]]
        assert syncs[0] == syncs[1] > 0, syncs
        print(network, layout, trace_report(ledgers))


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_no_host_wait_at_all_on_a_spatial_layout_over_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """D2 over the NCCL transport (its calls carried out by MPI on the stand-in's host
    memory, tests/standin_nccl.py): nothing in the step makes the host wait, the halo
    exchanges, gradient reductions and the loss vector included; one deferred read; the
    losses are those of the staging transport."""
    from mpi4py import MPI

    for network in sorted(NETWORKS):
        ledgers, reads, losses = counted_steps(MPI.COMM_WORLD, monkeypatch, network, D2,
                                               communication="nccl")
        check_steady_state(ledgers)
        assert [ledger.syncs for ledger in ledgers] == [[]] * STEPS
        assert reads == [["asnumpy"]] * STEPS
        assert any(launch.kernel.startswith("nccl.") for launch in ledgers[-1].launches)
        _, _, staged = counted_steps(MPI.COMM_WORLD, monkeypatch, network, D2)
        np.testing.assert_allclose(losses, staged, rtol=1e-12)
        print(network, "nccl", trace_report(ledgers))


def test_the_standin_computes_what_the_cpu_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's GPU path (gemm convolutions, fused and raw kernels on the host)
    gives the CPU path's losses to float32 rounding: the counts are of a real step."""
    from mpi4py import MPI

    _, _, device_losses = counted_steps(MPI.COMM_SELF, monkeypatch, "cosmoflow")
    np.testing.assert_allclose(device_losses, cpu_losses("cosmoflow"), rtol=1e-5)


def test_a_non_finite_step_is_never_applied_on_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1's targets hold a NaN: its loss is NaN and its gradients are too.  Neither
    step 1 nor step 2 (whose vote says the gradients before it were bad) changes a
    parameter or an optimizer slot, and both say so when read (``finite`` false, the
    vote counted), as the trainer needs to stop before anything is stored."""
    from mpi4py import MPI

    good = batch("cosmoflow")
    bad = (good[0], good[1].copy())
    bad[1][0, 0] = np.nan
    kept: list[dict[str, np.ndarray]] = []

    def snapshot(step: Any) -> dict[str, np.ndarray]:
        arrays = {name: p.data for name, p in step.model.named_parameters()}
        arrays.update({f"{n}.{k}": v for n, slots in step.optimizer.state.items()
                       for k, v in slots.items()})
        return {name: np.array(a.view(np.ndarray)) for name, a in arrays.items()}

    real_call = HybridStep.__call__

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_call(self, *args, **kwargs)
        kept.append(snapshot(self))
        return out
    monkeypatch.setattr(HybridStep, "__call__", recording)
    _, _, outs, _ = training(MPI.COMM_SELF, monkeypatch, "cosmoflow", [], [good, bad, good],
                             steps=3)
    assert outs[0].finite and not outs[1].finite and not outs[2].finite
    assert np.isnan(outs[1].loss) and outs[1].votes.bad_gradients == 0
    assert outs[2].votes.bad_gradients == 1 and np.isfinite(outs[2].loss)
    for later in kept[1:]:
        assert later.keys() == kept[0].keys()
        for name, array in kept[0].items():
            np.testing.assert_array_equal(later[name], array, err_msg=name)
