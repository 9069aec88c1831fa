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
arrays every step; a captured graph's stay where capture put them), copied from pinned
memory (a copy a graph can capture); the hyperparameters are written into device memory
by a launch (``engine/step_scalars.py``).  For a captured step the host's share of the
update (Adam's step counts, the hyperparameters) runs before each replay
(:meth:`MultiUpdate.advance`) and the captured launch only reads what it wrote.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """The table of the last update, reused while no array has moved; the tables of the
    two updates before are kept too, so that no pinned buffer is freed while a queued
    copy may still read it."""

    table: Any = None
    key: tuple = ()
    names: tuple = ()  # the parameters of the last launch, in its order
    kept: tuple = ()
    upload: Callable[[Any, np.ndarray], Any] | None = None  # host table -> device

    def table_for(self, roles: list[list[Any]], xp: Any) -> Any:
        key = tuple(address(a) for arrays in roles for a in arrays)
        if key != self.key:
            self.kept = (self.table, *self.kept[:1])
            self.table = raw_ops.tensor_table(roles, address, xp, self.upload)
            self.key = key
        return self.table

    def apply(self, optimizer: Optimizer, params: list, lr: float | None, skip: Any,
              hyper: Any, prepared: bool = False) -> bool:
        """One launch updating every parameter with a gradient, skipped on the device
        where ``skip`` is set; False (nothing done) when the kernels do not fit.
        ``hyper``: the device buffer the kernel reads its hyperparameters from, written
        here unless ``prepared`` (:meth:`advance` did, before a captured launch)."""
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
        self.names = tuple(n for n, _ in named)
        if not prepared:
            for name, param in named:
                _slots(optimizer, name, param.data, names, xp)
            raw_ops.put_values(hyper, _hyper(optimizer, self.names,
                                             _rate(optimizer, lr), first=all(fresh)))
        roles = [[p.data for _, p in named], [p.grad for _, p in named]]
        roles += [[optimizer.state[n][slot] for n, _ in named] for slot in names]
        kernel = "sgd_momentum_multi" if isinstance(optimizer, SGD) else "adam_multi"
        raw_ops.multi_update(kernel, self.table_for(roles, xp), hyper, skip.astype(np.int32))
        return True

    def advance(self, optimizer: Optimizer, lr: float | None, hyper: Any) -> None:
        """The host's share of the next update of the last launch's parameters, whose
        launch a graph replays: Adam's step counts, and the hyperparameters written into
        ``hyper``."""
        if isinstance(optimizer, Adam):
            for name in self.names:
                optimizer.state[name]["step"] += 1
        raw_ops.put_values(hyper, _hyper(optimizer, self.names, _rate(optimizer, lr),
                                         first=False))


def _rate(optimizer: Optimizer, lr: float | None) -> float:
    return optimizer.lr if lr is None else lr


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


def _hyper(optimizer: Optimizer, names: tuple, lr: float, first: bool) -> np.ndarray:
    if isinstance(optimizer, SGD):
        return raw_ops.sgd_hyper(optimizer.momentum, lr, first, optimizer.weight_decay)
    return raw_ops.adam_hyper(optimizer.beta1, optimizer.beta2, optimizer.eps, lr,
                              optimizer.state[names[0]]["step"], optimizer.weight_decay)
