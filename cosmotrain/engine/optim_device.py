"""A device step's optimizer update as one multi-tensor launch that skips on a device flag.

Why: on a device the step's verdict (may it be applied?) is a device flag
(``engine/device_verdict.py``); the update must apply or skip on it without the host
reading it.  ``kernels/cuda/src/optim.cu``'s ``sgd_momentum_multi`` and ``adam_multi``
take that flag and update every parameter in one launch, with
``kernels/compiled/native/optim.c``'s operations in its order (the bits of
``engine/optim.py``).  Where they do not fit (sharded optimizer state, SGD without
momentum, a slot missing on some parameters only, non-float32 arrays) the caller falls
back to :func:`~cosmotrain.engine.device_verdict.guarded_update`.

The address table is rebuilt when an array moved (one rank: the gradients are new
arrays every step) and the hyperparameters are uploaded every step: two small uploads,
no host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module
from cosmotrain.engine.optim import SGD, Adam, Optimizer
from cosmotrain.kernels.cuda import raw_ops

SLOTS = {SGD: ("momentum_buffer",), Adam: ("exp_avg", "exp_avg_sq")}


def address(array: Any) -> int:
    """The device address of ``array`` (cupy), or its host address (the stand-in's
    numpy arrays, run by the host build of the kernels)."""
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


@dataclass
class MultiUpdate:
    """The table of the last update, reused while no array has moved."""

    table: Any = None
    key: tuple = ()

    def table_for(self, roles: list[list[Any]], xp: Any) -> Any:
        key = tuple(address(a) for arrays in roles for a in arrays)
        if key != self.key:
            self.table, self.key = raw_ops.tensor_table(roles, address, xp), key
        return self.table

    def apply(self, optimizer: Optimizer, params: list, lr: float | None, skip: Any) -> bool:
        """One launch updating every parameter with a gradient, skipped on the device
        where ``skip`` is set; False (nothing done) when the kernels do not fit."""
        named = [(n, p) for n, p in params if p.grad is not None]
        names = SLOTS.get(type(optimizer))
        if not named or names is None or not _fits(optimizer, named):
            return False
        fresh = [optimizer.state.get(n) is None for n, _ in named]
        if any(fresh) and not all(fresh):
            return False  # "first" is one flag for the whole launch
        steps = {optimizer.state[n].get("step") for (n, _), f in zip(named, fresh) if not f}
        if len(steps) > 1:
            return False  # Adam: one step count (one bias correction) for the whole launch
        xp = array_module(named[0][1].data)
        rate = optimizer.lr if lr is None else lr
        for name, param in named:
            _slots(optimizer, name, param.data, names, xp)
        hyper = _hyper(optimizer, named, rate, first=all(fresh))
        roles = [[p.data for _, p in named], [p.grad for _, p in named]]
        roles += [[optimizer.state[n][slot] for n, _ in named] for slot in names]
        kernel = "sgd_momentum_multi" if isinstance(optimizer, SGD) else "adam_multi"
        raw_ops.multi_update(kernel, self.table_for(roles, xp), xp.asarray(hyper),
                             skip.astype(np.int32))
        return True


def _fits(optimizer: Optimizer, named: list) -> bool:
    if isinstance(optimizer, SGD) and not optimizer.momentum:
        return False
    arrays = [a for _, p in named for a in (p.data, p.grad)]
    return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


def _slots(optimizer: Optimizer, name: str, data: Any, names: tuple, xp: Any) -> None:
    """Create the slots of a first update: zeros (what a skipped first step leaves;
    SGD's kernel writes the gradient into its buffer on the first step, torch's rule)."""
    slot = optimizer.state.get(name)
    if slot is None:
        slot = optimizer.state[name] = {key: xp.zeros_like(data) for key in names}
        if isinstance(optimizer, Adam):
            slot["step"] = 0
    if isinstance(optimizer, Adam):
        slot["step"] += 1


def _hyper(optimizer: Optimizer, named: list, lr: float, first: bool) -> np.ndarray:
    if isinstance(optimizer, SGD):
        return raw_ops.sgd_hyper(optimizer.momentum, lr, first, optimizer.weight_decay)
    return raw_ops.adam_hyper(optimizer.beta1, optimizer.beta2, optimizer.eps, lr,
                              optimizer.state[named[0][0]]["step"], optimizer.weight_decay)
