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

from cosmotrain.tensor.redistribute import displacements


def _channel_major(block: Any) -> Any:
    return np.ascontiguousarray(np.moveaxis(block, 1, 0))


def _sample_major(buffer: Any) -> Any:
    return np.ascontiguousarray(np.moveaxis(buffer, 0, 1))


def _counts(pieces: Sequence[int], per_channel: int) -> list[int]:
    return [int(p) * per_channel for p in pieces]


def allgather_channels(comm: Any, block: Any, pieces: Sequence[int]) -> Any:
    """Concatenate along C every rank's block (``pieces[r]`` channels on rank ``r``)."""
    if comm.Get_size() == 1:
        return block
    n, _, *space = block.shape
    per_channel = n * int(np.prod(space))
    counts = _counts(pieces, per_channel)
    out = np.empty((sum(pieces), n, *space), dtype=block.dtype)
    comm.Allgatherv(_channel_major(block), [out, (counts, displacements(counts))])
    return _sample_major(out)


def reduce_scatter_channels(comm: Any, partial: Any, pieces: Sequence[int]) -> Any:
    """Sum the ranks' ``partial`` blocks and leave rank ``r`` its ``pieces[r]`` channels."""
    if comm.Get_size() == 1:
        return partial
    from mpi4py import MPI

    n, _, *space = partial.shape
    per_channel = n * int(np.prod(space))
    mine = pieces[comm.Get_rank()]
    out = np.empty((mine, n, *space), dtype=partial.dtype)
    comm.Reduce_scatter(_channel_major(partial), out, _counts(pieces, per_channel), op=MPI.SUM)
    return _sample_major(out)
