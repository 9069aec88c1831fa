"""A batch's int16 counts onto the device and through the input transform there.

Why (issue 35, "Input"): a float32 batch copied synchronously from pageable memory
cost 38 ms of a 194 ms bf16 step on the H200.  Here the reader's block stays int16
(half the bytes; ``Reader.keep_stored``), the host copies it into one of two pinned
buffers, the copy to the device is queued on a copy stream and an event recorded after
it; the compute stream waits on that event (a device-side wait: the host goes on
queueing the forward pass) and one kernel (``kernels/cuda/src/input.cu``) applies the
transform (log1p by the CPU's own table, or the mean) and the cast to the compute dtype.

Two slots, used in turn, so the host fills one while the other's copy may still run.
The two hazards of reusing a slot are ordered by events, never by a host wait in the
steady state:

- the host rewrites a slot's pinned buffer only once the copy that read it is done
  (``copied.done``: a query; the host waits only if the copy from two batches ago is
  somehow still running);
- the copy stream writes a slot's device buffer only after the compute stream has run
  the kernel that read it (the copy stream waits on ``consumed``).

The result is bit for bit what ``data.readers.transform.apply_transform`` gives on the
host, cast to the compute dtype (tests/test_input_stage.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cosmotrain.data.readers.transform import DeviceTransform, int16_log1p_table
from cosmotrain.engine.step_scalars import pinned_allocator
from cosmotrain.kernels.cuda import raw_ops


@dataclass
class Slot:
    """One pinned host buffer and its device twin, with the events that guard them."""

    host: np.ndarray  # pinned int16 counts
    device: Any  # int16 counts on the device
    host_divisors: np.ndarray  # pinned float32 divisors, one per row
    divisors: Any  # on the device
    copied: Any = None  # recorded on the copy stream after the copy from ``host``
    consumed: Any = None  # recorded on the compute stream after the kernel read ``device``


class InputStage:
    """Stages int16 blocks into the device's compute dtype (one per step on a device)."""

    def __init__(self, xp: Any, pinned: Any) -> None:
        """``xp``: cupy; ``pinned``: ``cupyx.empty_pinned``."""
        self.xp, self.pinned = xp, pinned
        self.copy_stream = xp.cuda.Stream(non_blocking=True)
        self.slots: list[Slot] = []
        self.turn = 0
        self.table: Any = None

    def __call__(self, counts: np.ndarray, transform: DeviceTransform, dtype: Any,
                 out: Any = None) -> Any:
        """``counts`` (int16, N C D H W, on the host) as a device array of ``dtype``
        (written into ``out`` when given: a captured graph's fixed input)."""
        if counts.size == 0:
            return self.xp.empty(counts.shape, dtype=dtype) if out is None else out
        slot = self._next_slot(counts.shape)
        self._upload(slot, counts, transform)
        compute = self.xp.cuda.get_current_stream()
        compute.wait_event(slot.copied)
        y = raw_ops.input_transform(slot.device, dtype, transform.name, False,
                                    table=self._table(), divisor=slot.divisors, out=out)
        slot.consumed = compute.record()
        return y

    def _upload(self, slot: Slot, counts: np.ndarray, transform: DeviceTransform) -> None:
        """Fill the slot's pinned buffers and queue their copies on the copy stream."""
        if slot.copied is not None and not slot.copied.done:
            slot.copied.synchronize()  # the copy of two batches ago still reads it
        np.copyto(slot.host, counts)
        divisors = transform.divisors if transform.divisors is not None else 1.0
        np.copyto(slot.host_divisors, divisors)
        if slot.consumed is not None:
            self.copy_stream.wait_event(slot.consumed)
        slot.device.set(slot.host, stream=self.copy_stream)
        slot.divisors.set(slot.host_divisors, stream=self.copy_stream)
        slot.copied = self.copy_stream.record()

    def _next_slot(self, shape: tuple[int, ...]) -> Slot:
        """The slot whose turn it is, (re)made for ``shape`` (the last batch may be short)."""
        if not self.slots or self.slots[0].host.shape != shape:
            for old in self.slots:  # freed pinned memory is reused: no copy may still read it
                if old.copied is not None and not old.copied.done:
                    old.copied.synchronize()
            self.slots = [self._slot(shape) for _ in range(2)]
            self.turn = 0
        slot = self.slots[self.turn]
        self.turn = 1 - self.turn
        return slot

    def _slot(self, shape: tuple[int, ...]) -> Slot:
        rows = (shape[0],)
        return Slot(self.pinned(shape, np.int16), self.xp.empty(shape, dtype=np.int16),
                    self.pinned(rows, np.float32), self.xp.empty(rows, dtype=np.float32))

    def _table(self) -> Any:
        """The float32 log1p of every int16 on the device, uploaded once (256 KiB)."""
        if self.table is None:
            self.table = self.xp.asarray(int16_log1p_table())
        return self.table


def device_stage(xp: Any) -> InputStage:
    """The stage of a job on the device of ``xp`` (cupy), with cupy's pinned host memory."""
    return InputStage(xp, pinned_allocator())
