"""One rank's halo buffer for a window layer: where its parts lie (pure, no MPI, no data).

A convolution or pooling on spatial blocks reads its input through a *halo buffer*: the
owned block with a margin on each side along D, H and W (one ``HaloPlan`` per dimension,
``tensor/windows.py``), which the halo exchange fills.  The local kernel reads the
*extended block* inside it: the owned planes, cropped by negative halos, extended by the
received ones, with zero padding on the global boundary only.  :class:`BufferLayout`
gives these parts as boxes (``tensor/boxes.py``) in buffer coordinates;
``layers/windowed.py`` allocates, fills, saves and rebuilds the buffers from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cosmotrain.tensor.boxes import Box, box_shape, intersect, onion, to_local
from cosmotrain.tensor.distribution import Distribution
from cosmotrain.tensor.windows import HaloPlan, WindowHalo, halo_plans, spatial_halos

Padding = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class BufferLayout:
    """One rank's window along D, H and W, and the boxes of its halo buffer."""

    halos: tuple[WindowHalo, WindowHalo, WindowHalo]
    plans: tuple[HaloPlan, HaloPlan, HaloPlan]

    @property
    def buffer_shape(self) -> tuple[int, ...]:
        """Planes of the buffer along D, H, W: low margin + owned block + high margin."""
        return tuple(p.buffer_size for p in self.plans)

    @property
    def extended(self) -> tuple[Any, ...]:
        """The extended block as a numpy index of a buffer (leading N, C kept)."""
        return (Ellipsis,) + tuple(p.extended for p in self.plans)

    @property
    def padding(self) -> Padding:
        """The kernel's zero padding ``(lo, hi)`` per dimension (global boundary only)."""
        return tuple((h.pad_lo, h.pad_hi) for h in self.halos)  # type: ignore[return-value]

    @property
    def has_output(self) -> bool:
        """Whether this rank's output block holds any element."""
        return all(h.out_range[1] > h.out_range[0] for h in self.halos)

    @property
    def extended_box(self) -> Box:
        """The extended block inside the buffer (buffer coordinates)."""
        return tuple((p.extended.start, p.extended.stop) for p in self.plans)

    @property
    def own_box(self) -> Box:
        """The owned block inside the buffer (buffer coordinates)."""
        return tuple((p.own.start, p.own.stop) for p in self.plans)

    @property
    def owned_part(self) -> Box:
        """The owned planes the extended block reads (buffer coordinates; may be empty)."""
        return intersect(self.extended_box, self.own_box)

    @property
    def owned_in_block(self) -> Box:
        """:attr:`owned_part` in the owned block's own indices (what to take of the block)."""
        return to_local(self.owned_part, self.own_box)

    def margins(self) -> list[Box]:
        """The buffer minus the owned block, as at most 6 slabs (zeroed before an exchange)."""
        return onion(tuple((0, n) for n in self.buffer_shape), self.own_box)

    def received(self) -> list[Box]:
        """The extended block minus the owned block, as at most 6 slabs: the received
        planes the kernel reads (small next to the block)."""
        return onion(self.extended_box, self.owned_part)

    def extended_shape(self, lead: Sequence[int]) -> tuple[int, ...]:
        """Shape of the extended block of a block whose leading dimensions are ``lead``."""
        return tuple(lead) + box_shape(self.extended_box)


def buffer_layout(dist: Distribution, coord: Sequence[int], kernel: Sequence[int],
                  stride: Sequence[int], padding: Sequence[tuple[int, int]]) -> BufferLayout:
    """The layout of the rank at ``coord`` (N, C, D, H, W) of a window layer's input ``dist``.

    Raises ``ValueError`` (``tensor.windows.check_halos``) when a halo would need more
    than a direct neighbour's block.
    """
    halos = spatial_halos(dist, kernel, stride, padding)
    spatial = tuple(coord)[2:]
    plans = tuple(halo_plans(h)[c] for h, c in zip(halos, spatial))
    mine = tuple(h[c] for h, c in zip(halos, spatial))
    return BufferLayout(mine, plans)  # type: ignore[arg-type]
