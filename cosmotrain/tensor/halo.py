"""Halo exchange: one routine, two modes, all neighbours at once.

A rank's *buffer* is its owned block with margins along D, H and W (``HaloPlan`` gives
the widths).  Forward (``replace``) fills the margins with the neighbours' planes;
backward (``add``) sends the margins' gradients back and adds them into the owners'
planes.  Both modes talk to the up to 26 face, edge and corner neighbours directly and
post every message at once, so :meth:`HaloExchange.start` returns immediately and the
caller computes (the interior in forward, the weight gradient in backward) while the
halos travel, whatever the number of split dimensions; :meth:`HaloExchange.finish`
waits and unpacks.  Distconv exchanges one dimension after another instead, which is
why it cannot overlap backward when more than one dimension is split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.runtime.job_runtime import Runtime
from cosmotrain.comm.transport import Exchange
from cosmotrain.tensor.windows import HaloPlan

Region = tuple[slice, slice, slice]
Pending = tuple[Exchange, list["_Message"]]


def _recv_slice(plan: HaloPlan, step: int) -> slice:
    """Where, along one dim of my buffer, the planes from the neighbour at ``step`` go."""
    return {-1: plan.margin_lo, 0: plan.own, 1: plan.margin_hi}[step]


def _send_slice(plan: HaloPlan, step: int) -> slice:
    """Which planes of my buffer the neighbour at ``step`` needs (buffer coordinates)."""
    if step == 0:
        return plan.own
    local = plan.send_lo if step < 0 else plan.send_hi
    return slice(plan.recv_lo + local.start, plan.recv_lo + local.stop)


def _extent(s: slice) -> int:
    return s.stop - s.start


def _tag(offset: Sequence[int]) -> int:
    """A tag naming the sender's offset towards the receiver (0..26)."""
    return (offset[0] + 1) * 9 + (offset[1] + 1) * 3 + (offset[2] + 1)


@dataclass
class _Message:
    peer: int
    recv_region: Region  # margin (forward) / margin gradient source (backward)
    send_region: Region  # owned planes the peer needs / where its gradient is added
    send_tag: int
    recv_tag: int


@dataclass
class HaloExchange:
    """The exchange pattern of one layer's input on this rank (built once per layer)."""

    grid: ProcessGrid
    plans: tuple[HaloPlan, HaloPlan, HaloPlan]  # this rank's plan along D, H, W
    runtime: Runtime = field(default_factory=Runtime)  # the transport and the timers
    messages: list[_Message] = field(default_factory=list)
    received: int = 0  # elements received so far, both modes (accounting)

    def __post_init__(self) -> None:
        for offset in self.grid.spatial_offsets():
            peer = self.grid.spatial_neighbour(offset)
            if peer is None:
                continue
            recv = tuple(_recv_slice(p, o) for p, o in zip(self.plans, offset))
            send = tuple(_send_slice(p, o) for p, o in zip(self.plans, offset))
            if all(_extent(s) for s in recv) or all(_extent(s) for s in send):
                back = tuple(-o for o in offset)
                self.messages.append(_Message(peer, recv, send, _tag(offset), _tag(back)))

    @property
    def buffer_shape(self) -> tuple[int, int, int]:
        return tuple(p.buffer_size for p in self.plans)  # type: ignore[return-value]

    @property
    def own(self) -> Region:
        return tuple(p.own for p in self.plans)  # type: ignore[return-value]

    def start(self, buffer: Any, mode: str) -> Pending:
        """Post every receive and send; ``mode`` is ``replace`` or ``add``."""
        if mode not in ("replace", "add"):
            raise ValueError(f"mode must be 'replace' or 'add', not {mode!r}")
        with self.runtime.timers.phase("halo"):
            return self._post(buffer, mode)

    def _post(self, buffer: Any, mode: str) -> Pending:
        """Pack and post through the runtime's transport (numpy: straight to MPI; device
        arrays: staged, CUDA-aware or NCCL, see ``cosmotrain/comm/transport/``)."""
        batch = self.runtime.transport.exchange(self.grid.cart, buffer)
        lead, unpack = buffer.shape[:2], []
        for msg in self.messages:
            outgoing, incoming = ((msg.send_region, msg.recv_region) if mode == "replace"
                                  else (msg.recv_region, msg.send_region))
            shape = lead + _region_shape(incoming)
            if math.prod(shape):
                batch.recv(shape, buffer.dtype, msg.peer, msg.recv_tag)
                unpack.append(msg)
                self.received += math.prod(shape)
            region = buffer[(...,) + outgoing]
            if region.size:
                batch.send(region, msg.peer, msg.send_tag)
        batch.start()
        return batch, unpack

    def finish(self, buffer: Any, pending: Pending, mode: str) -> None:
        """Wait for the messages and unpack: copy into margins, or add into owned planes."""
        batch, unpack = pending
        with self.runtime.timers.phase("halo"):
            for msg, inbox in zip(unpack, batch.wait()):
                if mode == "replace":
                    buffer[(...,) + msg.recv_region] = inbox
                else:
                    buffer[(...,) + msg.send_region] += inbox

    def exchange(self, buffer: Any, mode: str) -> None:
        """Blocking form: :meth:`start` then :meth:`finish`."""
        self.finish(buffer, self.start(buffer, mode), mode)

    def gather_margins(self, block: Any) -> list[tuple[Region, Any]]:
        """The forward (replace) exchange without a buffer, blocking: the neighbours'
        planes, each in an array of its own, with the region of the buffer it fills.

        The owned planes the neighbours need are sent straight from ``block`` (the owned
        block).  For a layer that reads the margins once (pooling): a buffer would be a
        block-sized copy, the largest array of its forward.
        """
        with self.runtime.timers.phase("halo"):
            batch = self.runtime.transport.exchange(self.grid.cart, block)
            lead, regions = block.shape[:2], []
            for msg in self.messages:
                shape = lead + _region_shape(msg.recv_region)
                if math.prod(shape):
                    batch.recv(shape, block.dtype, msg.peer, msg.recv_tag)
                    regions.append(msg.recv_region)
                    self.received += math.prod(shape)
                region = block[(...,) + self._in_block(msg.send_region)]
                if region.size:
                    batch.send(region, msg.peer, msg.send_tag)
            batch.start()
            return list(zip(regions, batch.wait()))

    def _in_block(self, region: Region) -> Region:
        """An owned region of the buffer in the owned block's own indices."""
        return tuple(slice(s.start - p.recv_lo, s.stop - p.recv_lo)  # type: ignore[return-value]
                     for s, p in zip(region, self.plans))


def _region_shape(region: Region) -> tuple[int, int, int]:
    return tuple(_extent(s) for s in region)  # type: ignore[return-value]
