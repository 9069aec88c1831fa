"""A device step's few host values kept in device memory: the step count, the guards'
votes, the optimizer's hyperparameters and, for a captured step, the targets.

Why: a kernel argument is baked into a captured CUDA graph (GPU_NOTES.md, "CUDA
graphs"), so whatever changes from one step to the next must reach the kernels through
memory that the host rewrites before each launch or replay:

* :class:`StepScalars` holds ``[step, 0, *votes]`` (float64: dropout's kernel reads the
  step, ``engine/device_verdict.py`` copies the rest as the base of the step's loss and
  vote vector) and the optimizer's hyperparameters (float32, ``kernels/cuda/src/optim.cu``
  reads them).  They are written by ``scalars.cu``'s launches, whose arguments carry
  the values: no copy from the host, no pinned buffer to keep, no host wait.
* :class:`PinnedRing` copies larger per-step arrays (the mini-batch's targets) into a
  fixed device buffer: through two pinned buffers used in turn, each rewritten only once
  the copy that read it is done (an event; the host waits only if the device is two
  steps behind).

On the eager device path the same launches run every step, so an eager step and a
replayed graph issue one trace (tests/test_cuda_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.engine.votes import Votes
from cosmotrain.kernels.cuda import raw_ops

HYPER_SLOTS = 8  # the most hyperparameters an update kernel reads (adam_multi's 8)


@dataclass
class StepScalars:
    """The step's values in device memory, allocated once and rewritten every step."""

    values: Any  # float64: [step, 0 (the loss sum's place), *votes]
    hyper: Any  # float32: the update kernel's hyperparameters

    @classmethod
    def allocate(cls, xp: Any, votes: Votes) -> StepScalars:
        return cls(xp.zeros(2 + len(votes.values()), dtype=np.float64),
                   xp.zeros(HYPER_SLOTS, dtype=np.float32))

    def write(self, step: int, votes: Votes) -> None:
        """This step's count and this rank's votes (one launch)."""
        raw_ops.put_values(self.values, [float(step), 0.0, *votes.values()])

    @property
    def step(self) -> Any:
        """The step count (one float64 element): ``Context.device_step``."""
        return self.values[0:1]

    @property
    def sums_base(self) -> Any:
        """``[0, *votes]``: the step's loss and vote vector before the loss is added."""
        return self.values[1:]


@dataclass
class _Slot:
    host: np.ndarray  # pinned
    copied: Any = None  # event recorded after the copy that reads ``host``


@dataclass
class PinnedRing:
    """Asynchronous host -> device copies of one shape through two pinned buffers."""

    pinned: Callable[[tuple, Any], np.ndarray]  # cupyx.empty_pinned
    slots: list[_Slot] = field(default_factory=list)
    turn: int = 0

    def copy(self, host: np.ndarray, target: Any, stream: Any) -> None:
        """Queue ``host``'s values into the device array ``target`` on ``stream``."""
        if not self.slots or self.slots[0].host.shape != host.shape \
                or self.slots[0].host.dtype != host.dtype:
            for old in self.slots:  # freed pinned memory is reused: no copy may read it
                _settle(old)
            self.slots = [_Slot(self.pinned(host.shape, host.dtype)) for _ in range(2)]
        slot = self.slots[self.turn]
        self.turn = 1 - self.turn
        _settle(slot)
        np.copyto(slot.host, host)
        target.set(slot.host, stream=stream)
        slot.copied = stream.record()


def _settle(slot: _Slot) -> None:
    """Wait for the copy that reads ``slot.host`` (only if it has not run yet)."""
    if slot.copied is not None and not slot.copied.done:
        slot.copied.synchronize()


def pinned_allocator() -> Callable[[tuple, Any], np.ndarray]:
    """cupy's pinned host memory (``cupyx.empty_pinned``)."""
    import cupyx  # type: ignore[import-not-found]  # present wherever cupy is

    return cupyx.empty_pinned


def pinned_upload(xp: Any, host: np.ndarray) -> tuple[Any, np.ndarray]:
    """``host`` on the device through a pinned copy queued on the current stream (a copy
    a CUDA graph can capture, unlike a pageable one): ``(device array, pinned buffer)``;
    the pinned buffer must live as long as a queued or captured copy may read it."""
    pinned = pinned_allocator()(host.shape, host.dtype)
    np.copyto(pinned, host)
    device = xp.empty(host.shape, dtype=host.dtype)
    device.set(pinned)
    return device, pinned
