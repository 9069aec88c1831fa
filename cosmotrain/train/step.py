"""One hybrid-parallel training step: forward, global loss, backward, reduction, update.

This is the unit the trainer loops over and the benchmarks time.  Every rank calls it
with its own input block and the targets of the whole mini-batch (tiny); it returns the
mini-batch loss, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.schema import Config
from cosmotrain.layers.hybrid import HybridModel, build_hybrid
from cosmotrain.layers.loss import batch_loss
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.train.grad_sync import GradientReducer
from cosmotrain.train.optim import Optimizer, build_optimizer


@dataclass
class StepOutput:
    """The mini-batch loss (every rank) and this rank's predictions, rows ``[start, stop)``."""

    loss: float
    pred: Any
    rows: tuple[int, int]


@dataclass
class HybridStep:
    """A distributed model with its optimizer and gradient reducer."""

    model: HybridModel
    optimizer: Optimizer
    reducer: GradientReducer
    loss: str = "mse"

    @property
    def grid(self) -> ProcessGrid:
        return self.model.grid

    def gradients(self, x: DistTensor, targets: Any, ctx: Context) -> StepOutput:
        """Forward and backward; afterwards every ``param.grad`` is the full gradient."""
        ctx = replace(ctx, on_grad_ready=self.reducer.on_grad_ready)
        self.reducer.prepare(self.model.reduction_groups())
        pred = self.model.forward(x, ctx)
        start, stop = self.model.sample_range()
        loss, dpred = batch_loss(pred, targets[start:stop], targets.size,
                                 self.grid.group_comms["all"], self.grid.timers, self.loss)
        self.model.backward(dpred, ctx)
        self.reducer.finish()
        return StepOutput(loss, pred, (start, stop))

    def update(self, lr: float | None = None) -> None:
        """Apply the optimizer and clear the gradients."""
        params = list(self.model.named_parameters())
        self.optimizer.step(params, lr)
        self.optimizer.zero_grad(params)

    def __call__(self, x: DistTensor, targets: Any, ctx: Context, lr: float | None = None
                 ) -> StepOutput:
        out = self.gradients(x, targets, ctx)
        self.update(lr)
        return out


def hybrid_step_from_config(cfg: Config, grid: ProcessGrid) -> HybridStep:
    """Model (initialised from ``train.seed``), its distributed twin, optimizer, reducer."""
    model = build_model(cfg.model, cfg.train.seed)
    width = cfg.model.width
    shape = (cfg.train.batch_size, cfg.model.channels, width, width, width)
    par = cfg.parallel
    hybrid = build_hybrid(model, grid, shape, par.bn_statistics, par.spatial_until,
                          par.channel_algorithm, par.layers)
    reducer = GradientReducer(grid.timers, par.bucket_mb)
    return HybridStep(hybrid, build_optimizer(cfg.optimizer), reducer)
