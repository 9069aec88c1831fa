"""Gradient reduction in buckets, overlapped with the backward pass.

Every rank of the data group (all sample groups and spatial blocks) holds a replica of
each parameter and computes a partial gradient (its samples, its blocks).  As soon as a
layer's gradients are final (``Context.on_grad_ready``) they are copied into the current
bucket; a full bucket starts a non-blocking allreduce and backward goes on while it
travels.  :meth:`GradientReducer.finish` flushes the last bucket, waits, and writes the
sums back.  Buckets are filled in backward order, which is the same on every rank, so
the collectives match.  With one rank in the group nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.timers import PhaseTimers
from cosmotrain.nn.module import Layer, Parameter

DEFAULT_BUCKET_MB = 25.0  # as PyTorch DDP


@dataclass
class _Bucket:
    params: list[Parameter] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class GradientReducer:
    """Sums parameter gradients over ``comm`` in buckets of about ``bucket_mb`` MiB."""

    comm: Any
    timers: PhaseTimers
    bucket_mb: float = DEFAULT_BUCKET_MB
    _open: _Bucket = field(default_factory=_Bucket)
    _in_flight: list[tuple[Any, Any, list[Parameter]]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.comm is not None and self.comm.Get_size() > 1

    def on_grad_ready(self, layer: Layer) -> None:
        """Queue ``layer``'s gradients; start the bucket's allreduce once it is full."""
        if not self.active:
            return
        for param in layer.params.values():
            if param.grad is None:
                raise RuntimeError(f"layer {layer.name!r} reported a missing gradient")
            self._open.params.append(param)
            self._open.nbytes += param.grad.nbytes
        if self._open.nbytes >= self.bucket_mb * 2**20:
            self._launch()

    def _launch(self) -> None:
        bucket, self._open = self._open, _Bucket()
        if not bucket.params:
            return
        with self.timers.phase("allreduce"):
            flat = np.concatenate([p.grad.ravel() for p in bucket.params])
            from mpi4py import MPI

            request = self.comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        self._in_flight.append((request, flat, bucket.params))

    def finish(self) -> None:
        """Reduce what is left, wait for every bucket and store the summed gradients."""
        if not self.active:
            return
        self._launch()
        with self.timers.phase("allreduce"):
            for request, flat, params in self._in_flight:
                request.Wait()
                start = 0
                for param in params:
                    size = param.grad.size
                    param.grad = flat[start:start + size].reshape(param.grad.shape)
                    start += size
        self._in_flight = []
