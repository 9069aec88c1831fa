"""Segmented collectives along the channel dimension of (N, C, D, H, W) blocks.

The channel/filter algorithms all-gather activations (or their gradients) along C and
reduce-scatter partial sums along C, each within a small sub-communicator; the
sub-communicators of one layer are disjoint, so every segment runs concurrently.
MPI cuts buffers along their slowest dimension, so blocks travel *channel-major*
(C, N, D, H, W): one copy in, one copy out, and none at all for a single sample.
Pieces may be uneven or empty (balanced fine blocks of few channels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cosmotrain.comm.transport import Transport, make_transport
from cosmotrain.device.xp import array_module
from cosmotrain.precision import is_bf16, narrow, widen


def _channel_major(block: Any) -> Any:
    xp = array_module(block)
    return xp.ascontiguousarray(xp.moveaxis(block, 1, 0))


def _sample_major(buffer: Any) -> Any:
    xp = array_module(buffer)
    return xp.ascontiguousarray(xp.moveaxis(buffer, 0, 1))


def _counts(pieces: Sequence[int], per_channel: int) -> list[int]:
    return [int(p) * per_channel for p in pieces]


def allgather_channels(comm: Any, block: Any, pieces: Sequence[int],
                       transport: Transport | None = None) -> Any:
    """Concatenate along C every rank's block (``pieces[r]`` channels on rank ``r``).

    ``transport`` moves device blocks (None: the host transport, numpy only); numpy
    blocks go straight to MPI."""
    if comm.Get_size() == 1:
        return block
    n, _, *space = block.shape
    per_channel = n * int(np.prod(space))
    counts = _counts(pieces, per_channel)
    out = array_module(block).empty((sum(pieces), n, *space), dtype=block.dtype)
    (transport or make_transport()).allgatherv(comm, _channel_major(block), out, counts)
    return _sample_major(out)


def reduce_scatter_channels(comm: Any, partial: Any, pieces: Sequence[int],
                            transport: Transport | None = None) -> Any:
    """Sum the ranks' ``partial`` blocks and leave rank ``r`` its ``pieces[r]`` channels.

    bfloat16 partial sums are added in float32 (widened before, rounded after)."""
    if comm.Get_size() == 1:
        return partial
    if is_bf16(partial):
        return narrow(reduce_scatter_channels(comm, widen(partial), pieces, transport))
    n, _, *space = partial.shape
    per_channel = n * int(np.prod(space))
    mine = pieces[comm.Get_rank()]
    out = array_module(partial).empty((mine, n, *space), dtype=partial.dtype)
    (transport or make_transport()).reduce_scatter(comm, _channel_major(partial), out,
                                                  _counts(pieces, per_channel))
    return _sample_major(out)
