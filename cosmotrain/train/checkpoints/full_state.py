"""Training state as full arrays and back: what checkpoints store and resume restores.

Under channel/filter parallelism each rank holds blocks of the split layers' parameters,
buffers and optimizer state.  :func:`full_state` gathers them into full arrays in PyTorch
layout (collective over the channel/filter group, assembled on one rank only; the other
groups hold replicas and skip it), so a checkpoint does not depend on the layout it was written under;
:func:`restore` cuts a checkpoint's arrays back into this rank's blocks under *any*
layout, which is what lets ``--resume`` change the strategy or the rank count.

A sharded optimizer (``parallel.shard_optimizer``) holds only a piece of each block's
state per rank: :func:`optimizer_blocks` first reassembles the blocks (collective over
every rank), and :func:`restore` cuts them to the pieces again, so the checkpoint is the
unsharded run's and any sharding resumes from any other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cosmotrain.device.xp import array_module, to_host
from cosmotrain.errors import DataError
from cosmotrain.layers.shards import Shard, gather_full
from cosmotrain.engine.step import HybridStep


def optimizer_blocks(step: HybridStep) -> dict[str, dict[str, Any]]:
    """The optimizer state in this rank's parameter blocks: the state itself, or under a
    sharded optimizer the blocks reassembled from the pieces (collective over every rank;
    complete on the ranks :func:`full_state` needs, rank 0 of each replica group)."""
    if step.shards is None:
        return step.optimizer.state
    return step.shards.gather(step.optimizer.state)


def full_state(step: HybridStep, root: int = 0, optimizer: dict | None = None
               ) -> tuple[dict, dict, dict] | None:
    """``(params, buffers, optimizer state)`` as full host arrays on the channel/filter
    group's rank ``root`` (collective over the group; None on its other ranks).

    ``optimizer``: :func:`optimizer_blocks`, which a sharded optimizer needs gathered on
    every rank first; None takes the step's (unsharded) state."""
    if optimizer is None:
        if step.shards is not None:
            raise RuntimeError("a sharded optimizer's state must be gathered first: pass "
                               "optimizer=optimizer_blocks(step), called on every rank")
        optimizer = step.optimizer.state
    model, group = step.model, step.grid.group_comms["channel_filter"]
    params = model.full_parameters(root)
    buffers = model.full_buffers(root)
    shards = {name: p.shard for name, p in model.named_parameters()}
    items, scalars = [], {}
    for name, slots in optimizer.items():
        for key, value in slots.items():
            if np.ndim(value):
                items.append((f"{name}\0{key}", value, shards.get(name)))
            else:
                scalars.setdefault(name, {})[key] = value
    gathered = gather_full(group, items, root)
    if gathered is None:
        return None
    optimizer: dict[str, dict[str, Any]] = {n: dict(s) for n, s in scalars.items()}
    for joined, value in gathered.items():
        name, key = joined.split("\0")
        optimizer.setdefault(name, {})[key] = value
    return params, buffers, optimizer


def restore(step: HybridStep, params: dict, buffers: dict, optimizer: dict,
            source: str = "checkpoint") -> None:
    """Load full (host) arrays into this rank's blocks, on its device (no communication)."""
    model = step.model
    for name, param in model.named_parameters():
        full_shape = param.shard.global_shape if param.shard is not None else param.shape
        block = _block(_need(params, name, source), param.shard, full_shape, name, source)
        param.data[...] = array_module(param.data).asarray(block)
    for name, layer, key in model.named_buffers():
        current = layer.buffers[key]
        shard = getattr(layer, "shard", None) if np.ndim(current) else None
        full_shape = shard.global_shape if shard is not None else tuple(np.shape(current))
        value = _block(_need(buffers, name, source), shard, full_shape, name, source)
        layer.buffers[key] = array_module(current).asarray(value.astype(current.dtype)) \
            if np.ndim(value) else type(current)(value)
    placed = {name: (p.shard, p.shard.global_shape if p.shard is not None else p.shape,
                     array_module(p.data)) for name, p in model.named_parameters()}
    state = {name: {key: placed[name][2].asarray(_block(value, *placed[name][:2],
                                                        f"{name}.{key}", source))
                    if np.ndim(value) else value for key, value in slots.items()}
             for name, slots in optimizer.items() if name in placed}
    step.optimizer.state = state if step.shards is None else step.shards.cut(state)


def _need(arrays: dict, name: str, source: str) -> Any:
    if name not in arrays:
        raise DataError(source, f"has no entry {name!r}",
                        "resume with the config (model) the checkpoint was written with",
                        kind="checkpoint")
    return arrays[name]


def _block(full: Any, shard: Shard | None, expected: tuple[int, ...], name: str,
           source: str) -> Any:
    """My block of ``full`` (a host copy); a shape that does not fit is a DataError."""
    full = np.asarray(to_host(full))
    if tuple(full.shape) != tuple(expected):
        raise DataError(source, f"entry {name!r} has shape {tuple(full.shape)}, the model "
                        f"needs {tuple(expected)}", "resume with the same model settings",
                        kind="checkpoint")
    return shard.take(full) if shard is not None else full.copy()
