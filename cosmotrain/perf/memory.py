"""Memory a training step needs, from the layer shapes (float32).

``saved``: what the layers keep from forward for backward (a convolution's input, an
activation's output (computed in place, so it is the previous layer's output buffer), batch norm's normalised input, a linear layer's input, a dropout mask);
``transient``: the largest gradient pair (dy, dx) alive at once in backward; ``grads``: the
parameter gradients.  The model input is not counted: it exists before the step.  The
benchmark compares a measured step peak against ``step_bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cosmotrain.nn.module import Layer
from cosmotrain.perf.flops import layer_costs

FLOAT = 4
_SAVES_INPUT = {"Conv3d": FLOAT, "BatchNorm3d": FLOAT, "Linear": FLOAT, "Dropout": 1}
_SAVES_OUTPUT = {"LeakyReLU": FLOAT, "ScaledTanh": FLOAT, "Pool3d": 0}


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
        if i > 0 or cost.kind not in _SAVES_INPUT:
            saved += _SAVES_INPUT.get(cost.kind, 0) * math.prod(cost.in_shape)
        saved += _SAVES_OUTPUT.get(cost.kind, 0) * math.prod(cost.out_shape)
    transient = max(FLOAT * (math.prod(c.in_shape) + math.prod(c.out_shape)) for c in costs)
    grads = FLOAT * sum(p.data.size for _, p in model.named_parameters())
    return StepMemory(saved, transient, grads)
