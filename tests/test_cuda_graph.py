"""The training step captured as one CUDA graph and replayed (engine/cuda_graph.py), run
on the CPU by the stand-in cupy, whose capture records instead of running and whose
graphs replay on the captured buffers (tests/standin_graph.py).

What these tests pin (docs/GPU.md, "CUDA graph"):

* a replayed step computes what the eager step computes, bit for bit, step after step,
  with a learning rate and dropout masks that change every step: nothing the graph
  reads is baked in at capture;
* a replayed step makes the host wait nowhere, allocates nothing, copies nothing from
  pageable memory, and issues one graph launch; besides it, only the writes of the
  step's own values (input, targets, step count, votes, hyperparameters) and the copy
  of its loss and votes out of the graph;
* a non-finite step is never applied by a replay either;
* what cannot be captured is named before the run (``true`` refuses, ``auto`` runs
  eagerly) or, if capture fails anyway, logged, and the run goes on eagerly.

The stand-in's convolutions are gemm (cuDNN does not import on the CPU), whose cuBLAS
products a capture refuses; these tests let the gemm module's products stand in for
cuDNN's convolutions (``blas_sites``), and nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import abort_on_error
from standin import installed
from standin_nccl import installed_nccl
from standin_graph import CaptureError
from test_gpu_step_counts import SCALAR_WRITES, batch, config

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.device.select import Device
from cosmotrain.engine import cuda_graph
from cosmotrain.engine.step import hybrid_step_from_config, job_runtime
from cosmotrain.errors import ConfigError
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor

# Stand-ins for what a device job captures through: the gemm products stand in for
# cuDNN's convolutions; the dense head multiplies with cuBLAS until it has its kernels.
CAPTURED_SITES = ("kernels/cuda/conv_gemm.py", "kernels/linear.py")
STAND_IN_REASONS = ("gemm convolutions", "dense layers")
WARMUP = 2
STEPS = 6


def allow_stand_in_convolutions(monkeypatch: pytest.MonkeyPatch, cupy: Any) -> None:
    real = cuda_graph.capture_blockers
    monkeypatch.setattr(cuda_graph, "capture_blockers", lambda *a: [
        r for r in real(*a) if not r.startswith(STAND_IN_REASONS)])
    cupy.graphs.blas_sites.update(CAPTURED_SITES)


def run(monkeypatch: pytest.MonkeyPatch, graph: str, batches: list, extra: list[str] = (),
        network: str = "cosmoflow", sites: tuple = CAPTURED_SITES, comm: Any = None
        ) -> dict[str, Any]:
    """``len(batches)`` steps on the stand-in GPU with ``device.cuda_graph: graph``, a
    learning rate that changes every step: each step's ledger, output and loss, and
    the parameters at the end."""
    cfg = config(network, [f"device.cuda_graph={graph}",
                           f"device.cuda_graph_warmup={WARMUP}", *extra])
    from mpi4py import MPI

    comm = comm or MPI.COMM_SELF
    with installed(monkeypatch) as cupy:
        allow_stand_in_convolutions(monkeypatch, cupy)
        cupy.graphs.blas_sites.intersection_update(sites)
        if cfg.device.communication == "nccl":
            installed_nccl(monkeypatch, cupy.ledger)
        grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
        device = Device("gpu", 0, cfg.device.precision, cfg.device.communication, "gemm")
        step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
        ledgers, losses, outs = [], [], []
        for it, (x, targets) in enumerate(batches):
            dist, coord = step.model.input_distribution(x.shape)
            cupy.ledger.take()
            out = step(DistTensor.scatter(x, dist, coord), targets,
                       Context(step=it, seed=cfg.train.seed), lr=0.002 * (1 + 0.5 * it))
            ledgers.append(cupy.ledger.take())
            outs.append(out)
            losses.append(out.loss)
        params = {n: np.array(p.data.view(np.ndarray)) for n, p in
                  step.model.named_parameters()}
        grid.free()
    return {"step": step, "ledgers": ledgers, "losses": losses, "outs": outs,
            "params": params, "captures": cupy.graphs.captures}


def short(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return pair[0][:1].copy(), pair[1][:1].copy()


def assert_same_training(eager: dict, graphed: dict) -> None:
    np.testing.assert_array_equal(graphed["losses"], eager["losses"])
    for name, value in eager["params"].items():
        np.testing.assert_array_equal(graphed["params"][name], value, err_msg=name)


@pytest.mark.parametrize("network, extra", [
    ("cosmoflow", []), ("mlperf", ["device.precision=bf16"]),
    ("cosmoflow", ["optimizer.name=adam"])])
def test_a_replayed_graph_trains_as_the_eager_step(network: str, extra: list[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-up, capture, replays and a short batch in between (eager: another shape),
    against the eager step: the same losses and parameters, bit for bit."""
    full = batch(network)
    batches = [full] * 4 + [short(full)] + [full] * (STEPS - 5)
    eager = run(monkeypatch, "false", batches, extra, network)
    graphed = run(monkeypatch, "true", batches, extra, network)
    assert eager["captures"] == 0 and graphed["captures"] == 1
    assert_same_training(eager, graphed)
    graph_launches = [len(ledger.graphs) for ledger in graphed["ledgers"]]
    assert graph_launches == [0, 0, 1, 1, 0, 1], graph_launches  # capture, replay, eager


def test_a_replayed_step_waits_for_nothing_and_allocates_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The replayed steps' ledgers: no host read, no allocation, no pageable copy, one
    graph launch; outside it only the step's own values go in and its sums come out;
    and the graph's launches are the captured step's, at the same addresses."""
    full = batch("cosmoflow")
    graphed = run(monkeypatch, "true", [full] * STEPS)
    replays = graphed["ledgers"][WARMUP + 1:]
    for ledger in replays:
        assert ledger.syncs == [] and ledger.allocations == [], ledger.sync_sites
        assert len(ledger.graphs) == 1
        start, count = ledger.graphs[0]
        around = [launch.kernel for launch in ledger.launches[:start]]
        around += [launch.kernel for launch in ledger.launches[start + count:]]
        assert set(around) <= {"copyto", "memcpy.htod", *SCALAR_WRITES, "setitem"}, around
    first, second = replays[-2].launches, replays[-1].launches
    assert [(a.kernel, a.signature, a.addresses) for a in first
            if a.kernel not in SCALAR_WRITES | {"setitem"}] == \
        [(b.kernel, b.signature, b.addresses) for b in second
         if b.kernel not in SCALAR_WRITES | {"setitem"}]


def test_a_graph_that_baked_the_step_values_in_would_be_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: replays that skip the writes of the step count and
    the learning rate (what a graph with its scalars baked in computes) train
    differently from the eager step."""
    full = batch("cosmoflow")
    eager = run(monkeypatch, "false", [full] * STEPS)
    monkeypatch.setattr(cuda_graph.StepGraph, "_prepare", lambda *args: None)
    baked = run(monkeypatch, "true", [full] * STEPS)
    assert baked["losses"][:WARMUP] == eager["losses"][:WARMUP]
    later = zip(baked["losses"][WARMUP + 1:], eager["losses"][WARMUP + 1:])
    assert all(a != b for a, b in later)


def test_a_non_finite_step_is_never_applied_by_a_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN target in a replayed step: neither it nor the step after it (whose vote
    carries the bad gradients, through the flag the graph keeps) changes a parameter,
    and both read as not finite."""
    good = batch("cosmoflow")
    bad = (good[0], good[1].copy())
    bad[1][0, 0] = np.nan
    before = run(monkeypatch, "true", [good] * 4)
    after = run(monkeypatch, "true", [good] * 4 + [bad, good])
    outs = after["outs"]
    assert [len(ledger.graphs) for ledger in after["ledgers"][3:]] == [1, 1, 1]
    assert not outs[4].finite and not outs[5].finite
    assert outs[5].votes.bad_gradients == 1
    for name, value in before["params"].items():
        np.testing.assert_array_equal(after["params"][name], value, err_msg=name)


def test_a_capture_that_fails_is_logged_and_the_run_goes_on_eagerly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The stand-in refuses the dense head's cuBLAS call inside the capture: under
    ``auto`` the reason is logged and the steps run eagerly, as without the graph;
    under ``true`` the run stops naming it."""
    full = batch("cosmoflow")
    only_convolutions = CAPTURED_SITES[:1]
    eager = run(monkeypatch, "false", [full] * 4)
    with caplog.at_level("WARNING", logger="cosmotrain.engine.cuda_graph"):
        fallback = run(monkeypatch, "auto", [full] * 4, sites=only_convolutions)
    assert "matmul (cuBLAS)" in caplog.text and "without the graph" in caplog.text
    assert fallback["captures"] == 0
    assert_same_training(eager, fallback)
    with pytest.raises(cuda_graph.CaptureFailed, match="cuBLAS"):
        run(monkeypatch, "true", [full] * 4, sites=only_convolutions)
    assert issubclass(CaptureError, RuntimeError)


class _Step:
    """What :func:`cuda_graph.capture_blockers` looks at."""

    def __init__(self, gpu: bool, conv: str = "cudnn", ranks: int = 1,
                 communication: str = "staging", momentum: float = 0.9) -> None:
        from cosmotrain.engine.optim import SGD
        from types import SimpleNamespace

        self.device = SimpleNamespace(is_gpu=gpu, conv_algorithm=conv,
                                      communication=communication)
        self.grid = SimpleNamespace(layout=SimpleNamespace(size=ranks))
        self.optimizer = SGD(lr=0.1, momentum=momentum)
        self.runtime = SimpleNamespace(conv=SimpleNamespace(dense="kernels"))


def test_what_keeps_a_step_out_of_the_graph_is_named_before_the_run(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = config("cosmoflow")
    assert cuda_graph.capture_blockers(cfg, _Step(gpu=True), {"Conv3d"}) == []
    reasons = cuda_graph.capture_blockers(cfg, _Step(True, "gemm", 2, momentum=0.0),
                                          {"Conv3d", "BatchNorm3d"})
    assert [r.split(" ")[0] for r in reasons] == ["gemm", "staging", "SGD", "batch"]
    assert cuda_graph.capture_blockers(cfg, _Step(True, ranks=2, communication="nccl"),
                                       set()) == []
    strict = config("cosmoflow", ["device.cuda_graph=true"])
    with pytest.raises(ConfigError, match="device.cuda_graph.*gemm convolutions"):
        cuda_graph.graph_for(strict, _Step(True, "gemm"), set())
    with caplog.at_level("INFO", logger="cosmotrain.engine.cuda_graph"):
        assert cuda_graph.graph_for(cfg, _Step(True, "gemm"), set()) is None
    assert "runs eagerly: gemm convolutions" in caplog.text
    off = config("cosmoflow", ["device.cuda_graph=false"])
    assert cuda_graph.graph_for(off, _Step(True), set()) is None
    assert cuda_graph.graph_for(cfg, _Step(False), set()) is None


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_a_graph_over_nccl_on_a_spatial_layout_trains_as_the_eager_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """D2 over the NCCL transport: halo exchanges, gradient reductions and the loss
    vector are NCCL calls, which a graph captures; its replays (the calls posted again
    on both ranks) give the eager step's losses and parameters bit for bit."""
    from mpi4py import MPI

    full = batch("cosmoflow")
    common = ["parallel.depth=2", "parallel.sample=1", "device.communication=nccl"]
    eager = run(monkeypatch, "false", [full] * 5, common, comm=MPI.COMM_WORLD)
    graphed = run(monkeypatch, "true", [full] * 5, common, comm=MPI.COMM_WORLD)
    assert graphed["captures"] == 1
    assert_same_training(eager, graphed)
    replayed = graphed["ledgers"][-1]
    assert replayed.syncs == [] and len(replayed.graphs) == 1
    start, count = replayed.graphs[0]
    assert any(launch.kernel == "nccl.send" for launch in
               replayed.launches[start:start + count])
