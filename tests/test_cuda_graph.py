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
cuDNN's convolutions (``blas_sites``), and nothing else: the dense head runs our own
kernels, which a job that captures chooses (``cuda_graph.graph_runtime``).  The eager
steps compared are the same job's before its capture (a warm-up longer than the run).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import abort_on_error
from standin import installed, shared
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

# The gemm products stand in for cuDNN's convolutions, which a device job captures.
CAPTURED_SITES = ("kernels/cuda/conv_gemm.py",)
STAND_IN_REASONS = ("gemm convolutions",)
WARMUP = 2
NEVER = 10**6  # a warm-up no run reaches: the same job, every step eager
STEPS = 6


def allow_stand_in_convolutions(monkeypatch: pytest.MonkeyPatch, cupy: Any) -> None:
    real = cuda_graph.capture_blockers
    monkeypatch.setattr(cuda_graph, "capture_blockers", lambda *a: [
        r for r in real(*a) if not r.startswith(STAND_IN_REASONS)])
    monkeypatch.setattr(cupy.graphs, "blas_sites", set(CAPTURED_SITES))


def run(monkeypatch: pytest.MonkeyPatch, graph: str, batches: list, extra: list[str] = (),
        network: str = "cosmoflow", sites: tuple = CAPTURED_SITES, comm: Any = None,
        read_late: bool = False) -> dict[str, Any]:
    """``len(batches)`` steps on the stand-in GPU with ``device.cuda_graph: graph``
    (``eager``: true, but never captured), a learning rate that changes every step:
    each step's ledger, output and loss (read after each step, or ``read_late`` after
    the last), and the parameters at the end."""
    warmup = NEVER if graph == "eager" else WARMUP
    cfg = config(network, [f"device.cuda_graph={'true' if graph == 'eager' else graph}",
                           f"device.cuda_graph_warmup={warmup}", *extra])
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
            if not read_late:
                losses.append(out.loss)
        losses = [out.loss for out in outs] if read_late else losses
        params = {n: np.array(p.data.view(np.ndarray)) for n, p in
                  step.model.named_parameters()}
        params.update({f"{n}.{k}": np.array(np.asarray(layer.buffers[k]).view(np.ndarray))
                       for n, layer, k in step.model.named_buffers()
                       if np.ndim(layer.buffers[k])})  # batch norm's running statistics
        grid.free()
    return {"step": step, "ledgers": ledgers, "losses": losses, "outs": outs,
            "params": params, "captures": cupy.graphs.captures}


def short(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return pair[0][:1].copy(), pair[1][:1].copy()


def varied(pair: tuple[np.ndarray, np.ndarray], count: int) -> list[tuple]:
    """``count`` batches, each its own data and targets (a replay must see each)."""
    return [(pair[0] * (1 + 0.25 * it), pair[1] + 0.5 * it) for it in range(count)]


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
    batches = varied(batch(network), STEPS)
    batches[4] = short(batches[4])
    eager = run(monkeypatch, "eager", batches, extra, network)
    graphed = run(monkeypatch, "true", batches, extra, network)
    assert eager["captures"] == 0 and graphed["captures"] == 1
    assert_same_training(eager, graphed)
    graph_launches = [len(ledger.graphs) for ledger in graphed["ledgers"]]
    assert graph_launches == [0, 0, 1, 1, 0, 1], graph_launches  # capture, replay, eager


@pytest.mark.parametrize("network", ["cosmoflow", "mlperf"])
def test_a_replayed_step_waits_for_nothing_and_allocates_nothing(
        network: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replayed steps' ledgers: no host read, no allocation, no pageable copy, one
    graph launch; outside it only the step's own values go in and its sums come out;
    and the graph's launches are the captured step's, at the same addresses."""
    graphed = run(monkeypatch, "true", varied(batch(network), STEPS), network=network)
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
    eager = run(monkeypatch, "eager", [full] * STEPS)
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
    """A dense head left on cuBLAS, which the blockers did not see: the stand-in
    refuses its call inside the capture.  Under ``auto`` the reason is logged and the
    steps run eagerly, as without the graph; under ``true`` the run stops naming it."""
    from cosmotrain.engine import step as step_module

    full = batch("cosmoflow")
    eager = run(monkeypatch, "false", [full] * 4)
    monkeypatch.setattr(step_module, "graph_runtime", lambda cfg, runtime, *a: runtime)
    monkeypatch.setattr(cuda_graph, "capture_blockers", lambda *a: [])
    with caplog.at_level("WARNING", logger="cosmotrain.engine.cuda_graph"):
        fallback = run(monkeypatch, "auto", [full] * 4)
    assert "matmul (cuBLAS)" in caplog.text and "without the graph" in caplog.text
    assert fallback["captures"] == 0
    assert_same_training(eager, fallback)
    with pytest.raises(cuda_graph.CaptureFailed, match="cuBLAS"):
        run(monkeypatch, "true", [full] * 4)
    assert issubclass(CaptureError, RuntimeError)


def _device(gpu: bool = True, conv: str = "cudnn", communication: str = "staging") -> Any:
    """What :func:`cuda_graph.capture_blockers` reads of a device."""
    from types import SimpleNamespace

    return SimpleNamespace(is_gpu=gpu, conv_algorithm=conv, communication=communication)


def test_what_keeps_a_step_out_of_the_graph_is_named_before_the_run(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = config("cosmoflow")
    blockers = cuda_graph.capture_blockers
    assert blockers(cfg, _device(), 1, {"Conv3d", "Linear"}, "kernels") == []
    sgd_plain = config("cosmoflow", ["optimizer.momentum=0"])
    reasons = blockers(sgd_plain, _device(conv="gemm"), 2, {"Linear", "BatchNorm3d"},
                       "cublas")
    assert [r.split(" ")[0] for r in reasons] == ["gemm", "staging", "SGD", "dense"]
    assert blockers(cfg, _device(communication="nccl"), 2, set()) == []
    assert blockers(cfg, _device(gpu=False), 1, set()) == ["the step runs on the CPU"]


def test_true_refuses_at_start_up_and_auto_runs_eagerly_naming_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On the stand-in (gemm convolutions) ``true`` stops the job before its first
    step with a config error naming the reason; ``auto`` logs it and builds no runner;
    a capturable job's dense head is switched to our kernels, an eager one's is not."""
    from mpi4py import MPI

    def build(graph: str) -> Any:
        cfg = config("cosmoflow", [f"device.cuda_graph={graph}"])
        grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
        try:
            device = Device("gpu", 0, cfg.device.precision, "staging", "gemm")
            return hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
        finally:
            grid.free()

    with installed(monkeypatch):
        with pytest.raises(ConfigError, match="device.cuda_graph.*gemm convolutions"):
            build("true")
        with caplog.at_level("INFO", logger="cosmotrain.engine.cuda_graph"):
            eager = build("auto")
        assert eager.graph is None and eager.runtime.conv.dense == "cublas"
        assert "runs eagerly: gemm convolutions" in caplog.text
        allow_stand_in_convolutions(monkeypatch, shared())
        graphed = build("auto")
        assert graphed.graph is not None and graphed.runtime.conv.dense == "kernels"
        assert build("false").graph is None


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_graphs_over_nccl_train_as_the_eager_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """D2 over the NCCL transport (halo exchanges, gradient reductions and the loss
    vector are NCCL calls, which a graph captures), and N2 with the optimizer state
    sharded (reduce-scatter, one update launch over the shard pieces, all-gathers):
    the replays (the calls posted again on both ranks) give the eager step's losses and
    parameters bit for bit."""
    from mpi4py import MPI

    full = batch("cosmoflow")
    for layout, collective in ((["parallel.depth=2", "parallel.sample=1"], "nccl.send"),
                               (["parallel.sample=2", "parallel.shard_optimizer=true"],
                                "nccl.reduceScatter")):
        common = [*layout, "device.communication=nccl"]
        eager = run(monkeypatch, "eager", varied(full, 5), common, comm=MPI.COMM_WORLD)
        graphed = run(monkeypatch, "true", varied(full, 5), common, comm=MPI.COMM_WORLD)
        assert graphed["captures"] == 1
        assert_same_training(eager, graphed)
        replayed = graphed["ledgers"][-1]
        assert replayed.syncs == [] and len(replayed.graphs) == 1
        start, count = replayed.graphs[0]
        kernels = [launch.kernel for launch in replayed.launches[start:start + count]]
        assert collective in kernels, sorted(set(kernels))


def test_losses_read_long_after_their_steps_are_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's sums go through two buffers in turn; a step whose values nobody read
    before its buffer comes round again is read then, so every loss read later is its
    own step's (the trainer reads each at the next step, and never waits for this)."""
    full = batch("cosmoflow")
    eager = run(monkeypatch, "eager", [full] * STEPS)
    from cosmotrain.engine.device_verdict import DeferredSums

    real_read = DeferredSums.read
    calls: list[int] = []
    monkeypatch.setattr(DeferredSums, "read",
                        lambda self: calls.append(1) or real_read(self))
    late = run(monkeypatch, "true", [full] * STEPS, read_late=True)
    assert late["losses"] == eager["losses"]
    assert calls  # the runner read the steps nobody had read before their buffer's reuse
