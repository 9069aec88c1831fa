"""One CUDA graph for the steady-state training step (``device.cuda_graph``).

Why: at batch 1 the H200 spent 48.8 ms of a paper-network step launching kernels,
against PyTorch's 5.4 (docs/PERFORMANCE.md, "GPU").  A captured graph launches the
step's few hundred kernels with one call.  NVIDIA's MLPerf HPC CosmoFlow code does
the same after its warm-up steps (GPU_NOTES.md).

How (:class:`StepGraph`):

* the first ``device.cuda_graph_warmup`` steps run eagerly.  They create the optimizer's
  slots, build and tune the cuDNN plans, and upload the constant tables;
* the next step is captured on the runner's own stream, under a private memory pool
  that lives as long as the graph, then launched.  Each later step launches it again;
* what changes from step to step reaches the graph through memory at fixed addresses,
  rewritten before each launch:
  * the input block goes into one device buffer (the stage's transform writes there);
  * the targets go in through pinned memory;
  * the step count (dropout's streams), the votes and the hyperparameters are written
    by one launch each (``engine/step_scalars.py``);
  * the verdict on the last gradients stays in one device flag;
* the loss and vote vector the graph leaves is copied into one of two buffers in turn,
  so the one-step-late read (``train/deferred.py``) sees its own step's values.

A batch of another shape (the last, short batch of an epoch) runs eagerly.  Nothing in
the graph may make the host wait, call cuBLAS, copy from pageable memory or allocate
outside the pool.  :func:`capture_blockers` names what in a job would, before the run:
``auto`` then trains eagerly and logs why, and ``true`` refuses to start.  A capture
that fails anyway, or one that rebinds the model's state, is logged and the run goes on
eagerly (``true``: it stops).  The stand-in cupy runs all of this on the CPU
(tests/standin_graph.py, tests/test_cuda_graph.py).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cosmotrain.config.schema import Config
from cosmotrain.engine.device_verdict import DeferredSums
from cosmotrain.engine.step_scalars import PinnedRing, pinned_allocator
from cosmotrain.errors import ConfigError
from cosmotrain.tensor.dist_tensor import DistTensor

LOG = logging.getLogger(__name__)


class CaptureFailed(RuntimeError):
    """``device.cuda_graph: true`` and the step could not be captured."""


def capture_blockers(cfg: Config, device: Any, ranks: int, kinds: set[str],
                     dense: str = "kernels") -> list[str]:
    """What in this job keeps its step out of a CUDA graph (empty: nothing): ``device``
    the job's, ``ranks`` its size, ``kinds`` the network's layer classes, ``dense`` how
    its linear layers compute.  The same on every rank: it reads the config and the
    job's device, not the machine."""
    if not device.is_gpu:
        return ["the step runs on the CPU"]
    reasons = []
    if device.conv_algorithm == "gemm":
        reasons.append("gemm convolutions multiply with cuBLAS, which cupy cannot "
                       "capture (device.conv_algorithm: cudnn)")
    if ranks > 1 and device.communication != "nccl":
        reasons.append(f"{device.communication} MPI makes the host wait for every message "
                       "(device.communication: nccl)")
    if cfg.optimizer.name == "sgd" and not cfg.optimizer.momentum:
        reasons.append("SGD without momentum updates outside the multi-tensor kernel "
                       "(optimizer.momentum > 0)")
    if "Linear" in kinds and dense == "cublas":
        reasons.append("dense layers multiply with cuBLAS, which cupy cannot capture")
    return reasons


def graph_runtime(cfg: Config, runtime: Any, ranks: int, kinds: set[str]) -> Any:
    """``runtime`` with the dense layers on our kernels when the step will be captured
    (cuBLAS cannot be), else as it is: cuBLAS stays the dense layers' eager default
    until the two are timed on a device (``gpu_check.sh bench-dense``)."""
    if cfg.device.cuda_graph is False or capture_blockers(cfg, runtime.device, ranks, kinds):
        return runtime
    return replace(runtime, conv=replace(runtime.conv, dense="kernels"))


def graph_for(cfg: Config, step: Any, kinds: set[str]) -> StepGraph | None:
    """The graph runner of ``step`` under ``device.cuda_graph``, or None (eager);
    ``kinds``: the network's layer classes."""
    mode = cfg.device.cuda_graph
    if mode is False:
        return None
    reasons = capture_blockers(cfg, step.device, step.grid.layout.size, kinds,
                               step.runtime.conv.dense)
    if reasons and mode is True:
        raise ConfigError("device.cuda_graph", "the step cannot be captured: "
                          + "; ".join(reasons), "fix those, or set device.cuda_graph: auto")
    if reasons:
        if step.device.is_gpu:
            LOG.info("device.cuda_graph: auto: the step runs eagerly: %s", "; ".join(reasons))
        return None
    return StepGraph(step.device.xp, cfg.device.cuda_graph_warmup, strict=mode is True)


@dataclass
class StepGraph:
    """Warm-up, capture and replay of one step's graph (see the module's docstring)."""

    xp: Any
    warmup: int
    strict: bool = False
    stream: Any = None
    calls: int = 0
    graph: Any = None
    pool: Any = None  # the private pool: lives as long as the graph (or what it made)
    off: str = ""  # why the runner went back to eager steps
    x: Any = None  # the graph's input block
    targets: Any = None  # the graph's targets
    captured: Any = None  # the captured step's output (prediction, sums)
    sums: list = field(default_factory=list)  # two buffers, used in turn
    issued: list = field(default_factory=lambda: [None, None])  # their DeferredSums
    ring: PinnedRing | None = None  # the targets' way in
    blocks: PinnedRing | None = None  # an input block's, when it needs no transform
    kept: tuple = ()  # what the graph's copies read (the update's address table)

    def __post_init__(self) -> None:
        # a blocking stream: ordered with work on the default stream (validation,
        # checkpoint reads) without an event
        self.stream = self.stream or self.xp.cuda.Stream()
        self.ring = self.ring or PinnedRing(pinned_allocator())
        self.blocks = self.blocks or PinnedRing(pinned_allocator())

    def __call__(self, step: Any, x: DistTensor, targets: Any, ctx: Any, lr: Any,
                 votes: Any, transform: Any) -> Any:
        with self.stream:
            if self.graph is not None and self._fits(x, targets):
                out = self._replay(step, x, targets, ctx, lr, votes, transform)
            elif self.graph is None and not self.off and self.calls >= self.warmup:
                out = self._capture(step, x, targets, ctx, lr, votes, transform)
            else:
                out = step.eager(x, targets, ctx, lr, votes, transform)
        self.calls += 1
        return out

    @property
    def replaying(self) -> bool:
        return self.graph is not None

    def _fits(self, x: DistTensor, targets: Any) -> bool:
        return tuple(x.data.shape) == tuple(self.x.shape) and \
            tuple(np.shape(targets)) == tuple(self.targets.shape)

    def _place(self, step: Any, x: DistTensor, targets: Any, transform: Any) -> DistTensor:
        """The block and targets into the graph's buffers (made at the capture): a
        block of the compute dtype through pinned memory, int16 counts through the
        input stage's transform, anything else copied and cast (which allocates)."""
        if self.x is None:
            placed = step.place_input(x, transform)
            self.x = self.xp.empty_like(placed.data)
            self.xp.copyto(self.x, placed.data)
            self.targets = self.xp.empty(np.shape(targets), dtype=np.asarray(targets).dtype)
        elif transform is None and x.data.dtype == self.x.dtype:
            self.blocks.copy(x.data, self.x, self.stream)
        else:
            step.place_input(x, transform, out=self.x)
        self.ring.copy(np.asarray(targets), self.targets, self.stream)
        return DistTensor(self.x, x.dist, x.coord)

    def _prepare(self, step: Any, ctx: Any, lr: Any, votes: Any) -> None:
        """The host's share of a captured step: its values into device memory."""
        step.write_scalars(ctx, votes)
        step.device_update.advance(step.optimizer, lr, step.scalars.hyper)

    def _capture(self, step: Any, x: DistTensor, targets: Any, ctx: Any, lr: Any,
                 votes: Any, transform: Any) -> Any:
        if not step.device_update.names:
            return self._give_up(step.eager(x, targets, ctx, lr, votes, transform),
                                 "the warm-up's update did not fit the multi-tensor kernels")
        placed = self._place(step, x, targets, transform)
        self._prepare(step, ctx, lr, votes)
        before = state_ids(step)
        self.pool = self.xp.cuda.MemoryPool()
        with self.xp.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                out = step.eager(placed, self.targets, ctx, lr, votes, None, prepared=True)
            except Exception as error:  # noqa: BLE001 - the capture's reason, logged
                with contextlib.suppress(Exception):  # the capture is abandoned anyway
                    self.stream.end_capture()
                again = step.eager(placed, self.targets, ctx, lr, votes, None, prepared=True)
                return self._give_up(again, f"capturing the step failed: {error}")
            graph = self.stream.end_capture()
        graph.launch(self.stream)
        moved = [name for name, ident in state_ids(step).items() if before.get(name) != ident]
        if moved:
            return self._give_up(out, "the captured step rebinds " + ", ".join(moved[:3]))
        self.graph, self.captured = graph, out
        self.kept = (step.device_update.table,)
        LOG.info("device.cuda_graph: captured the training step after %d eager steps",
                 self.calls)
        return self._output(out)

    def _replay(self, step: Any, x: DistTensor, targets: Any, ctx: Any, lr: Any,
                votes: Any, transform: Any) -> Any:
        self._place(step, x, targets, transform)
        self._prepare(step, ctx, lr, votes)
        self.graph.launch(self.stream)
        return self._output(self.captured)

    def _output(self, out: Any) -> Any:
        """The step's output, its sums copied out of the graph's buffer into the one of
        two that the next step's replay does not write.  The step two before used that
        buffer: its values are read first if nobody has (the trainer reads each step at
        the next, so this never waits there)."""
        if not self.sums:
            self.sums = [self.xp.zeros_like(out.sums.values) for _ in range(2)]
        turn = self.calls % 2
        if self.issued[turn] is not None:
            self.issued[turn].read()
        self.sums[turn][...] = out.sums.values
        sums = DeferredSums(self.sums[turn], out.sums.global_count, out.sums.votes)
        self.issued[turn] = sums
        return type(out)(out.pred, out.rows, sums)

    def _give_up(self, out: Any, why: str) -> Any:
        self.off = why
        if self.strict:
            raise CaptureFailed(f"device.cuda_graph: true, but {why}; set "
                                "device.cuda_graph: auto to train without the graph")
        LOG.warning("device.cuda_graph: %s; the run goes on without the graph", why)
        return out


def state_ids(step: Any) -> dict[str, int]:
    """Which object holds each piece of the step's state: the parameters, the array
    buffers, the optimizer's slots and the gradient flag.  A captured graph writes
    where these were at capture, so none may be rebound by it."""
    named = {f"parameter {n}": p.data for n, p in step.model.named_parameters()}
    named.update({f"buffer {n}.{k}": layer.buffers[k]
                  for n, layer, k in step.model.named_buffers() if np.ndim(layer.buffers[k])})
    named.update({f"optimizer slot {n}.{k}": v for n, slots in step.optimizer.state.items()
                  for k, v in slots.items() if np.ndim(v)})
    named["gradient flag"] = step.gradients_bad
    return {name: id(value) for name, value in named.items()}
