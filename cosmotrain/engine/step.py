"""One hybrid-parallel training step: forward, global loss, backward, reduction, update.

This is the unit the trainer loops over and the benchmarks time.  Every rank calls it
with its own input block and the targets of the whole mini-batch (tiny); it returns the
mini-batch loss, the same on every rank.

The step owns the rank's :class:`~cosmotrain.device.select.Device`: the parameters (float32
masters), batch-norm statistics, gradient buckets and optimizer state live there, and
the input block is copied there once per batch (and stored as bf16 under
``precision: bf16``).  On the CPU in float32 all of this is the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import KernelThreads, Runtime, build_runtime
from cosmotrain.config.schema import Config, DeviceConfig
from cosmotrain.device import step_memory
from cosmotrain.device.select import Device, host_device, select_device
from cosmotrain.device.xp import all_finite, is_device_array
from cosmotrain.layers.hybrid import HybridModel, build_hybrid
from cosmotrain.layers.loss import loss_and_sums, loss_sums_on_device
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.cuda_graph import graph_for, graph_runtime
from cosmotrain.engine.device_verdict import (DeferredSums, apply_flag, gradients_nonfinite,
                                              guarded_update, vote_vector)
from cosmotrain.engine.grad_sync import GradientReducer
from cosmotrain.engine.optim import Optimizer, build_optimizer
from cosmotrain.data.readers.transform import DeviceTransform, host_transform
from cosmotrain.engine.input_stage import InputStage, device_stage
from cosmotrain.engine.optim_device import MultiUpdate
from cosmotrain.engine.optim_shards import OptimizerShards
from cosmotrain.engine.step_scalars import StepScalars, pinned_upload
from cosmotrain.engine.votes import Votes


@dataclass
class StepOutput:
    """The mini-batch loss (every rank) and this rank's predictions, rows ``[start, stop)``.

    ``votes`` are the guards' votes summed over every rank, the same on each
    (:class:`~cosmotrain.engine.votes.Votes`): how many ranks asked to stop (a signal) and
    how many found the *previous* step's gradients non-finite.  ``sums`` holds them with
    the loss: host values on the CPU, or on a device a
    :class:`~cosmotrain.engine.device_verdict.DeferredSums` that the first look at
    ``loss``, ``votes`` or ``finite`` reads back, once, after the step.
    """

    pred: Any
    rows: tuple[int, int]
    sums: tuple[float, Votes] | DeferredSums = (0.0, Votes())

    @property
    def deferred(self) -> bool:
        """Whether the loss and votes are still on the device (a device step)."""
        return isinstance(self.sums, DeferredSums)

    def _values(self) -> tuple[float, Votes]:
        return self.sums.read() if isinstance(self.sums, DeferredSums) else self.sums

    @property
    def loss(self) -> float:
        return self._values()[0]

    @property
    def votes(self) -> Votes:
        return self._values()[1]

    @property
    def finite(self) -> bool:
        """Whether the step may be applied: a finite loss and finite gradients before it."""
        return math.isfinite(self.loss) and not self.votes.bad_gradients


@dataclass
class HybridStep:
    """A distributed model with its optimizer and gradient reducer; ``shards`` when the
    optimizer state is sharded over each parameter's replicas (``parallel.shard_optimizer``,
    the reducer then reduce-scatters)."""

    model: HybridModel
    optimizer: Optimizer
    reducer: GradientReducer
    loss: str = "mse"
    device: Device = field(default_factory=Device)
    # this rank's last gradients held NaN/Inf (not yet agreed); a device flag on a device
    gradients_bad: Any = False
    shards: OptimizerShards | None = None
    applies: Any = None  # device step: the flag "the step may be applied" (no host read)
    multi: MultiUpdate = field(default_factory=MultiUpdate)  # device step: one-launch update
    stage: InputStage | None = None  # device step: int16 batches in (engine/input_stage.py)
    scalars: StepScalars | None = None  # device step: step count, votes, hyperparameters
    graph: Any = None  # device step: the CUDA graph runner (engine/cuda_graph.py), or None
    _bad_flag: Any = None  # device step: where each step leaves ``gradients_bad``

    @property
    def grid(self) -> ProcessGrid:
        return self.model.grid

    @property
    def runtime(self) -> Runtime:
        """The job's runtime: device, transport, communication timers, GPU kernel
        settings, kernel threads."""
        return self.model.runtime

    def place_input(self, x: DistTensor, transform: DeviceTransform | None = None,
                    out: Any = None) -> DistTensor:
        """The reader's host block on this rank's device: the one host -> device copy of
        a batch, cast to bf16 under ``precision: bf16`` (other dtypes are kept: float64
        in the tests).  The block itself when nothing changes (the CPU in float32).
        With ``transform`` the block holds int16 counts, staged and transformed on the
        device (:mod:`cosmotrain.engine.input_stage`).  ``out``: a device array the
        block is written into (a captured graph's input)."""
        dtype = self.device.storage_dtype if self.device.precision == "bf16" else None
        if transform is not None and self.device.is_gpu:
            self.stage = self.stage or device_stage(self.device.xp)
            data = self.stage(x.data, transform, dtype or np.float32, out=out)
            return DistTensor(data, x.dist, x.coord)
        if transform is not None:  # on the host, as the reader would have done it
            x = DistTensor(host_transform(x.data, transform), x.dist, x.coord)
        data = self.device.to_device(x.data, dtype)
        if out is not None:
            self.device.xp.copyto(out, data)
            return DistTensor(out, x.dist, x.coord)
        return x if data is x.data else DistTensor(data, x.dist, x.coord)

    def gradients(self, x: DistTensor, targets: Any, ctx: Context,
                  votes: Votes | None = None, transform: DeviceTransform | None = None,
                  prepared: bool = False) -> StepOutput:
        """Forward and backward; afterwards every ``param.grad`` is the full gradient
        (with ``shards``: this rank holds its shard of each bucket's reduced gradient,
        ``Bucket.shard``, and the gradients of unbucketed parameters).

        ``votes`` (this rank's; the step casts ``bad_gradients`` itself, its verdict on the
        previous step's gradients) ride in the loss allreduce, and the output holds their
        sums.  When the loss or those gradients are non-finite, backward is skipped on
        every rank alike and the output says so.  On a device the step count and votes
        are written into device memory first (:meth:`write_scalars`; ``prepared``: the
        graph runner did, before a captured launch).
        """
        x = self.place_input(x, transform)
        if self.device.is_gpu:
            if not prepared:
                self.write_scalars(ctx, votes)
            ctx = replace(ctx, device_step=self.scalars.step)
        ctx = replace(ctx, on_grad_ready=self.reducer.on_grad_ready)
        self.reducer.prepare(self.model.reduction_groups())
        pred = self.model.forward(x, ctx)
        start, stop_row = self.model.sample_range()
        if is_device_array(pred):
            return self._device_gradients(pred, targets, (start, stop_row), votes, ctx)
        mine = replace(votes if votes is not None else Votes(),
                       bad_gradients=int(self.gradients_bad))
        loss, dpred, sums = loss_and_sums(pred, targets[start:stop_row], targets.size,
                                          self.grid, self.runtime.timers, self.loss,
                                          extra=mine.values())
        out = StepOutput(pred, (start, stop_row), (loss, mine.summed(sums)))
        if not out.finite:
            return out
        self.model.backward(dpred, ctx)
        self.reducer.finish()
        self.gradients_bad = not all_finite(self.reducer.reduced_gradients(
            p for _, p in self.model.named_parameters()))
        return out

    def _device_gradients(self, pred: Any, targets: Any, rows: tuple[int, int],
                          votes: Votes | None, ctx: Context) -> StepOutput:
        """:meth:`gradients` on a device, with no host read (``engine/device_verdict.py``):
        the loss and votes stay on the device (the output reads them when asked),
        backward always runs, and :attr:`applies` and :attr:`gradients_bad` are device
        flags that :meth:`update` applies or skips on."""
        mine = replace(votes if votes is not None else Votes(), bad_gradients=0)
        previous = self.gradients_bad if is_device_array(self.gradients_bad) else None
        base = self.scalars.sums_base
        sums, dpred = loss_sums_on_device(
            pred, targets[rows[0]:rows[1]], targets.size,
            lambda total: vote_vector(total, mine, previous, base), self.grid,
            self.runtime.transport, self.runtime.timers, self.loss)
        self.applies = apply_flag(sums, mine)
        self.model.backward(dpred, ctx)
        self.reducer.finish()
        self._keep_bad_flag(gradients_nonfinite(self.reducer.reduced_gradients(
            p for _, p in self.model.named_parameters())))
        return StepOutput(pred, rows, DeferredSums(sums, targets.size, mine))

    def write_scalars(self, ctx: Context, votes: Votes | None) -> None:
        """The step count and this rank's votes into device memory (one launch): what
        dropout's kernel and the loss and vote vector read (``engine/step_scalars.py``)."""
        mine = votes if votes is not None else Votes()
        if self.scalars is None:
            self.scalars = StepScalars.allocate(self.device.xp, mine)
        self.scalars.write(ctx.step, mine)

    def _keep_bad_flag(self, bad: Any) -> None:
        """This step's verdict on its gradients into the one flag every step writes, so
        that the next step (or a replayed graph) reads it where the last one left it."""
        if bad is None:
            self.gradients_bad = None
            return
        if self._bad_flag is None:
            self._bad_flag = self.device.xp.zeros((), dtype=bool)
        self._bad_flag[...] = bad
        self.gradients_bad = self._bad_flag

    def update(self, lr: float | None = None, prepared: bool = False) -> None:
        """Apply the optimizer and clear the gradients.

        A rank whose gradients are non-finite keeps its parameters (sharded: its shards
        of them): the next step's loss allreduce tells every rank, and the run stops
        before anything is stored.  On a device the verdicts are device flags, and the
        update applies or skips on them without the host looking (a step that may not be
        applied, or this rank's non-finite gradients): one multi-tensor launch
        (``engine/optim_device.py``; ``prepared``: its hyperparameters already written,
        by the graph runner), or else the update run and undone there."""
        params = list(self.model.named_parameters())
        skip = self._device_skip()
        if skip is None:
            self._apply(params, lr, bool(self.gradients_bad))
        elif not self._multi_apply(params, lr, skip, prepared):
            guarded_update(lambda: self._updated_arrays(params), skip,
                           lambda: self._apply(params, lr, False))
        self.optimizer.zero_grad(params)

    def _multi_apply(self, params: list, lr: float | None, skip: Any, prepared: bool) -> bool:
        """The one-launch update (sharded: over this rank's shard pieces, then the
        all-gathers); False where the kernels do not fit."""
        if self.shards is not None:
            return self.shards.device_step(self.optimizer, params, lr, skip,
                                           self.scalars.hyper, prepared)
        self.multi.upload = self.multi.upload or pinned_upload
        return self.multi.apply(self.optimizer, params, lr, skip, self.scalars.hyper, prepared)

    @property
    def device_update(self) -> MultiUpdate:
        """The multi-tensor update in use (the shards' own when sharded)."""
        return self.shards.device_update if self.shards is not None else self.multi

    def _apply(self, params: list, lr: float | None, skip: bool) -> None:
        if self.shards is not None:
            self.shards.step(self.optimizer, params, lr, skip=skip)
        elif not skip:
            self.optimizer.step(params, lr)

    def _device_skip(self) -> Any:
        """The device flag "skip this update", or None on the CPU."""
        if self.applies is None:
            return None
        if self.gradients_bad is None:  # no gradient on this rank
            return ~self.applies
        return ~self.applies | self.gradients_bad

    def _updated_arrays(self, params: list) -> list[Any]:
        """The arrays an update writes: the parameters and the optimizer's slots."""
        return [p.data for _, p in params] + [
            v for slots in self.optimizer.state.values() for v in slots.values()
            if np.ndim(v)]

    def __call__(self, x: DistTensor, targets: Any, ctx: Context, lr: float | None = None,
                 votes: Votes | None = None, transform: DeviceTransform | None = None
                 ) -> StepOutput:
        """One training step; its large host arrays are placed by the plan learnt from
        the steps before (:mod:`cosmotrain.device.step_memory`, once installed)."""
        with step_memory.phase("train"):
            if self.graph is not None:
                return self.graph(self, x, targets, ctx, lr, votes, transform)
            return self.eager(x, targets, ctx, lr, votes, transform)

    def eager(self, x: DistTensor, targets: Any, ctx: Context, lr: float | None = None,
              votes: Votes | None = None, transform: DeviceTransform | None = None,
              prepared: bool = False) -> StepOutput:
        """One step as issued, kernel by kernel (what a CUDA graph captures)."""
        out = self.gradients(x, targets, ctx, votes, transform, prepared)
        if out.deferred or out.finite:  # deferred: the device flags decide
            self.update(lr, prepared)
        return out

    def non_finite_ranks(self) -> int:
        """How many ranks hold a non-finite gradient, parameter, buffer or optimizer slot
        (collective over every rank): the check before a checkpoint or a validation."""
        from mpi4py import MPI

        arrays = [p.data for _, p in self.model.named_parameters()]
        arrays += [layer.buffers[key] for _, layer, key in self.model.named_buffers()
                   if np.ndim(layer.buffers[key])]
        arrays += [v for slots in self.optimizer.state.values() for v in slots.values()
                   if np.ndim(v)]
        bad = bool(self.gradients_bad) or not all_finite(arrays)  # a device flag: read
        return self.grid.group_comms["all"].allreduce(int(bad), op=MPI.SUM)


def job_runtime(cfg: Config, grid: ProcessGrid, device: Device | None = None,
                threads: KernelThreads | None = None) -> Runtime:
    """The runtime of a job of ``cfg`` on ``grid`` (collective), on ``device`` (the job's
    :func:`~cosmotrain.device.select.select_device`), with the job's kernel ``threads``
    (:func:`~cosmotrain.runtime.threads.job_threads`, applied here once; None leaves the
    process's threads as they are).  A job (``threads`` given) also applies
    ``device.reuse_freed_memory`` and ``device.plan_step_memory``, process-wide like the
    threads.

    Without a device the config's ``device`` section decides, with ``auto`` meaning the
    CPU: library calls and tests stay on the host unless they ask for a GPU (``backend:
    gpu`` selects one collectively over the grid).  On a GPU the transport follows the
    device's communication mode and the runtime carries the device's convolution
    settings, which the layers built on it pass to the GPU kernels
    (:func:`~cosmotrain.runtime.job_runtime.build_runtime`).
    """
    device = device if device is not None else _default_device(cfg.device, grid)
    return build_runtime(device, grid.cart, threads,
                         reuse_memory=threads is not None and cfg.device.reuse_freed_memory,
                         plan_memory=cfg.device.plan_step_memory)


def hybrid_step_from_config(cfg: Config, grid: ProcessGrid,
                            runtime: Runtime | None = None) -> HybridStep:
    """Model (initialised from ``train.seed``), its distributed twin, optimizer, reducer,
    on the job's ``runtime`` (built once with the job; :func:`job_runtime` of ``cfg``
    when None): the layers and the reducer take their transport and timers from it, the
    convolution and linear layers its GPU kernel settings.
    """
    runtime = runtime if runtime is not None else job_runtime(cfg, grid)
    model = build_model(cfg.model, cfg.train.seed)
    kinds = {type(layer).__name__ for layer in model.layers()}
    runtime = graph_runtime(cfg, runtime, grid.layout.size, kinds)
    device = runtime.device
    width = cfg.model.width
    shape = (cfg.train.batch_size, cfg.model.channels, width, width, width)
    par = cfg.parallel
    hybrid = build_hybrid(model, grid, shape, par.bn_statistics, runtime=runtime)
    place_model(hybrid, device)
    reducer = GradientReducer(runtime.timers, par.bucket_mb, transport=runtime.transport,
                              shard=par.shard_optimizer)
    shards = OptimizerShards(hybrid, reducer) if par.shard_optimizer else None
    step = HybridStep(hybrid, build_optimizer(cfg.optimizer), reducer, device=device,
                      shards=shards)
    step.graph = graph_for(cfg, step, kinds)
    return step


def _default_device(cfg: DeviceConfig, grid: ProcessGrid) -> Device:
    return select_device(cfg, grid.cart) if cfg.backend == "gpu" else host_device(cfg)


def place_model(model: HybridModel, device: Device) -> None:
    """Move the parameters (float32 masters) and array buffers (batch-norm running
    statistics) to ``device``; on the CPU every array stays the object it is."""
    for _, param in model.named_parameters():
        param.data = device.to_device(param.data)
    for _, layer, key in model.named_buffers():
        if np.ndim(layer.buffers[key]):
            layer.buffers[key] = device.to_device(layer.buffers[key])
