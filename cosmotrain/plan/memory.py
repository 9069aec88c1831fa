"""Memory a training step needs, from the layer shapes (float32).

``saved``: what the layers keep from forward for backward (a convolution's input, an
activation's output (computed in place, so it is the previous layer's output buffer),
batch norm's normalised input, a linear layer's input, a dropout mask); ``transient``:
the largest gradients alive at once in backward: dy and dx of one layer, or dy alone
where backward works in place (LeakyReLU) or computes no input gradient (the first
layer); ``grads``: the parameter gradients.  The model input is not counted: it exists
before the step.  The benchmark compares a measured step peak against ``step_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cosmotrain.nn.module import Layer
from cosmotrain.plan.flops import LayerCost, layer_costs

if TYPE_CHECKING:
    from cosmotrain.plan.workload import Workload

FLOAT = 4
_SAVES_INPUT = {"Conv3d": FLOAT, "BatchNorm3d": FLOAT, "Linear": FLOAT, "Dropout": 1}
_SAVES_OUTPUT = {"LeakyReLU": FLOAT, "ScaledTanh": FLOAT}
_IN_PLACE_BACKWARD = {"LeakyReLU"}


@dataclass(frozen=True)
class StepMemory:
    saved: int
    transient: int
    grads: int

    @property
    def step_bytes(self) -> int:
        return self.saved + self.transient + self.grads


def training_memory(model: Layer, input_shape: tuple[int, ...]) -> StepMemory:
    costs = layer_costs(model, input_shape)
    saved = 0
    for i, cost in enumerate(costs):
        if i > 0:  # the first layer's saved input is the model input itself
            saved += _SAVES_INPUT.get(cost.kind, 0) * math.prod(cost.in_shape)
        saved += _SAVES_OUTPUT.get(cost.kind, 0) * math.prod(cost.out_shape)
    transient = max(_backward_arrays(c, first=i == 0) for i, c in enumerate(costs))
    grads = FLOAT * sum(p.data.size for _, p in model.named_parameters())
    return StepMemory(saved, transient, grads)


def _backward_arrays(cost: LayerCost, first: bool) -> int:
    """Bytes of the gradients one layer's backward holds at once."""
    dy = FLOAT * math.prod(cost.out_shape)
    if first or cost.kind in _IN_PLACE_BACKWARD:
        return dy
    return dy + FLOAT * math.prod(cost.in_shape)


@dataclass(frozen=True)
class RankMemory:
    """Bytes the busiest rank holds at the peak of a step, by what holds them."""

    state: float  # parameters, gradients and optimizer state of what it holds
    activations: float  # saved for backward + the largest gradient pair of backward
    inputs: float  # its block of the mini-batch

    @property
    def total(self) -> float:
        return self.state + self.activations + self.inputs


def workload_memory(work: Workload) -> float:
    """Bytes the busiest rank of a :class:`~cosmotrain.plan.workload.Workload` holds at peak
    (:func:`rank_memory`'s total)."""
    return rank_memory(work).total


def rank_memory(work: Workload) -> RankMemory:
    """The peak of the busiest rank of ``work``, by part.

    Parameters, gradients and optimizer state of what it holds (the state of 1/R of each
    group's parameters under ``parallel.shard_optimizer``); the input block; what the
    layers save for backward on their local shapes (a convolution's saved input includes
    its halo margins); the largest gradient pair alive in backward; the all-gathered input
    of a channel-split convolution is counted as its saved input.
    """
    held = FLOAT * (2 * work.params_held + work.optimizer_slots * work.state_held)
    saved = 0.0
    for layer in work.layers:
        margins = sum(t.elements for t in layer.transfers if t.kind == "halo") / \
            (2.0 if layer.input_grad else 1.0)
        saved += _SAVES_INPUT.get(layer.kind, 0) * (math.prod(layer.in_shape) + margins)
        saved += _SAVES_OUTPUT.get(layer.kind, 0) * math.prod(layer.out_shape)
    transient = max((FLOAT * (math.prod(layer.out_shape) +
                              (math.prod(layer.in_shape) if layer.input_grad else 0))
                     for layer in work.layers), default=0)
    return RankMemory(held, saved + transient, FLOAT * work.input_elements)
