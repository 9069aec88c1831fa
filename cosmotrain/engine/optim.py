"""SGD with momentum and Adam, numerically identical to ``torch.optim``.

State is kept per parameter *name*, so a checkpoint stores it under the same keys as the
parameters and a distributed run can keep only the state of the blocks it owns.  Weight
decay is L2 (added to the gradient), as in ``torch.optim.SGD`` / ``torch.optim.Adam``.
Updates are in place and in the parameter's dtype (float32), and element-wise: applied
to a contiguous piece of a parameter (:meth:`Optimizer.apply`, the sharded optimizer of
``engine/optim_shards.py``) they give that piece of the whole update, bit for bit.
float32 numpy arrays take compiled loops with the same operations in the same order
(``kernels/optim_update.py``: one pass instead of ten, the same bits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cosmotrain.config.schema import OptimizerConfig
from cosmotrain.device.xp import array_module
from cosmotrain.kernels import optim_update
from cosmotrain.nn.module import Parameter

NamedParams = Iterable[tuple[str, Parameter]]


@dataclass
class Optimizer:
    lr: float
    weight_decay: float = 0.0
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def step(self, params: NamedParams, lr: float | None = None) -> None:
        """Apply one update to every parameter that has a gradient."""
        rate = self.lr if lr is None else lr
        for name, param in params:
            if param.grad is not None:
                self.apply(name, param.data, param.grad, rate)

    def apply(self, name: str, data: Any, grad: Any, lr: float) -> None:
        """Update ``data`` (the parameter ``name``, or a piece of it, flat) in place from
        its gradient ``grad``: weight decay, then the rule; the state slots take the shape
        of ``data``."""
        if self.weight_decay:
            grad = grad + data * data.dtype.type(self.weight_decay)
        self.update(name, data, grad, lr)

    def update(self, name: str, data: Any, grad: Any, lr: float) -> None:
        raise NotImplementedError

    @staticmethod
    def zero_grad(params: NamedParams) -> None:
        for _, param in params:
            param.grad = None


@dataclass
class SGD(Optimizer):
    momentum: float = 0.9

    def update(self, name: str, data: Any, grad: Any, lr: float) -> None:
        if self.momentum:
            slot = self.state.setdefault(name, {})
            if "momentum_buffer" not in slot:
                slot["momentum_buffer"] = grad.copy()
            elif optim_update.sgd_momentum(data, grad, slot["momentum_buffer"],
                                           self.momentum, lr):
                return  # the compiled loop: the same operations, fused
            else:
                buf = slot["momentum_buffer"]
                buf *= buf.dtype.type(self.momentum)
                buf += grad
            grad = slot["momentum_buffer"]
        data -= grad * data.dtype.type(lr)


@dataclass
class Adam(Optimizer):
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def update(self, name: str, data: Any, grad: Any, lr: float) -> None:
        xp = array_module(data)
        slot = self.state.get(name)
        if slot is None:  # not setdefault: its default would allocate two zeroed arrays a call
            slot = self.state[name] = {"step": 0, "exp_avg": xp.zeros_like(data),
                                       "exp_avg_sq": xp.zeros_like(data)}
        slot["step"] += 1
        t = slot["step"]
        dtype = data.dtype.type
        m, v = slot["exp_avg"], slot["exp_avg_sq"]
        step_size = lr / (1 - self.beta1 ** t)
        bias2_sqrt = math.sqrt(1 - self.beta2 ** t)
        if optim_update.adam(data, grad, m, v, self.beta1, self.beta2, self.eps, bias2_sqrt,
                             step_size):
            return  # the compiled loop: the operations below, fused
        # One scratch array of the parameter's size, the operations in torch's order.
        scratch = grad * dtype(1 - self.beta1)
        m *= dtype(self.beta1)
        m += scratch
        xp.multiply(grad, grad, out=scratch)
        scratch *= dtype(1 - self.beta2)
        v *= dtype(self.beta2)
        v += scratch
        xp.sqrt(v, out=scratch)
        scratch /= dtype(bias2_sqrt)
        scratch += dtype(self.eps)
        xp.divide(m, scratch, out=scratch)
        scratch *= dtype(step_size)
        data -= scratch


def build_optimizer(cfg: OptimizerConfig) -> Optimizer:
    """The optimizer named by ``cfg.name`` with its hyper-parameters."""
    if cfg.name == "sgd":
        return SGD(lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
    return Adam(lr=cfg.lr, weight_decay=cfg.weight_decay, beta1=cfg.beta1, beta2=cfg.beta2,
                eps=cfg.eps)
