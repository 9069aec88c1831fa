"""Redistribution: move a tensor from one distribution to another (all-to-all).

Each rank of a communicator holds one block of a *source* distribution and wants one
block of a *target* distribution of the same global tensor.  What rank ``r`` sends to
rank ``q`` is the intersection of its source block with ``q``'s target block; one
``Alltoallv`` moves everything.  The plan (who sends what) is pure index math computed
once from every rank's two grid coordinates.  A redistribution is a permutation of the
tensor's elements, so its adjoint (the backward pass) is its inverse: the same plan run
the other way (:meth:`Redistribution.reverse`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cosmotrain.comm.transport import Transport, make_transport
from cosmotrain.device.xp import array_module
from cosmotrain.tensor.boxes import Box, box_empty, box_shape, box_slices, intersect, to_local
from cosmotrain.tensor.distribution import Distribution


def _size(box: Box | None) -> int:
    return 0 if box is None else math.prod(box_shape(box))


@dataclass
class Redistribution:
    """This rank's part of moving ``src`` blocks to ``dst`` blocks over ``comm``.

    ``send[q]`` is the local box (``tensor/boxes.py``) of my source block that rank ``q``
    receives and ``recv[q]`` the local box of my target block that rank ``q`` fills; None
    where the blocks do not overlap (nothing moves).  ``transport`` moves device blocks
    (None: the host transport, numpy blocks only).
    """

    comm: Any
    src: Distribution
    dst: Distribution
    src_coord: tuple[int, ...]
    dst_coord: tuple[int, ...]
    send: list[Box | None]
    recv: list[Box | None]
    transport: Transport | None = None

    @classmethod
    def plan(cls, comm: Any, src: Distribution, src_coord: Sequence[int],
             dst: Distribution, dst_coord: Sequence[int],
             transport: Transport | None = None) -> Redistribution:
        """Build the plan (collective: every rank of ``comm`` calls it once)."""
        if src.global_shape != dst.global_shape:
            raise ValueError(f"cannot redistribute {src.global_shape} into "
                             f"{dst.global_shape}: the global shapes differ")
        coords = comm.allgather((tuple(src_coord), tuple(dst_coord)))
        mine_src, mine_dst = src.box(tuple(src_coord)), dst.box(tuple(dst_coord))
        send, recv = [], []
        for their_src, their_dst in coords:
            out = intersect(mine_src, dst.box(their_dst))
            into = intersect(src.box(their_src), mine_dst)
            send.append(None if box_empty(out) else to_local(out, mine_src))
            recv.append(None if box_empty(into) else to_local(into, mine_dst))
        covered = sum(_size(b) for b in recv)
        if covered != math.prod(dst.local_shape(tuple(dst_coord))):
            raise ValueError("the source blocks of the communicator's ranks do not cover "
                             "this rank's target block exactly once")
        return cls(comm, src, dst, tuple(src_coord), tuple(dst_coord), send, recv, transport)

    def reverse(self) -> Redistribution:
        """The plan from ``dst`` back to ``src`` (the adjoint and the inverse)."""
        return Redistribution(self.comm, self.dst, self.src, self.dst_coord, self.src_coord,
                              self.recv, self.send, self.transport)

    def __call__(self, block: Any) -> Any:
        """My target block, given my source block (collective)."""
        expected = self.src.local_shape(self.src_coord)
        if tuple(block.shape) != expected:
            raise ValueError(f"source block of shape {tuple(block.shape)}, the plan "
                             f"expects {expected}")
        return alltoallv_boxes(self.comm, block, self.send, self.recv,
                               self.dst.local_shape(self.dst_coord), self.transport)


def alltoallv_boxes(comm: Any, block: Any, send: list[Box | None], recv: list[Box | None],
                    out_shape: tuple[int, ...], transport: Transport | None = None) -> Any:
    """Send box ``send[q]`` of ``block`` to rank ``q``; fill box ``recv[q]`` of the result."""
    xp = array_module(block)
    sendbuf, send_counts = _pack(block, send)
    recv_counts = [_size(box) for box in recv]
    recvbuf = xp.empty(sum(recv_counts), dtype=block.dtype)
    (transport or make_transport()).alltoallv(comm, sendbuf, send_counts, recvbuf, recv_counts)
    out = xp.empty(out_shape, dtype=block.dtype)
    start = 0
    for box, count in zip(recv, recv_counts):
        if box is not None:
            out[box_slices(box)] = recvbuf[start:start + count].reshape(box_shape(box))
        start += count
    return out


def _pack(block: Any, boxes: list[Box | None]) -> tuple[Any, list[int]]:
    counts = [_size(box) for box in boxes]
    buf = array_module(block).empty(sum(counts), dtype=block.dtype)
    start = 0
    for box, count in zip(boxes, counts):
        if box is not None:
            buf[start:start + count] = block[box_slices(box)].ravel()
        start += count
    return buf, counts
