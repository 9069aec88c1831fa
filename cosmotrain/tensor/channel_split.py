"""Channel/filter parallelism: who holds which weights and channels (pure index math).

The ``parallel.channel x parallel.filter`` ranks that share a sample group and a spatial
block form a *channel/filter group* of ``G`` ranks (group rank ``j``).  Between layers an
activation's channels are cut into ``G`` balanced *fine blocks*, fine block ``j`` on group
rank ``j``, so every block-wise layer (activation, batch norm, pooling, dropout) runs on
its channels unchanged.

A convolution ``y_f = sum_c x_c * w_fc`` factors the group as ``c x f`` (``c * f = G``)
with ``j = ic * f + if`` and gives rank ``j`` the weight block ``w[F_if, C_ic]``:

* ``C_ic``: the fine input-channel blocks ``ic*f .. ic*f + f - 1`` (contiguous), which the
  ``f`` ranks sharing ``ic`` hold between them: an all-gather over them yields ``x[C_ic]``;
* ``F_if``: the fine filter blocks ``if, f + if, 2f + if, ...`` (one per ``ic``, strided),
  so that the reduce-scatter of the partial outputs over the ``c`` ranks sharing ``if``
  leaves fine block ``j`` on rank ``j``: the output is again in the standard layout and
  no permutation is ever needed between layers.

The SC19 algorithms (Dryden et al.) are the three factorisations:

* stationary-x, ``(G, 1)``: ``x`` never moves; partial outputs of every filter are
  reduce-scattered; backward all-gathers ``dL/dy``; ``dL/dx`` is local;
* stationary-y, ``(1, G)``: ``x`` is all-gathered; each rank computes its own filters;
  backward reduce-scatters ``dL/dx``;
* stationary-w, ``(parallel.channel, parallel.filter)``: both, on the two axes.

Each rank stores ``1/G`` of the weights whatever the algorithm, and weight gradients are
reduced only over the ranks holding the same block (same group rank, other sample
groups and spatial blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cosmotrain.tensor.distribution import block_range

ALGORITHMS = ("x", "y", "w")


@dataclass(frozen=True)
class Factor:
    """A ``channel x filter`` factorisation of a group of ``channel * filter`` ranks."""

    channel: int
    filter: int

    def __post_init__(self) -> None:
        if self.channel < 1 or self.filter < 1:
            raise ValueError(f"Factor needs positive ways, got {self.channel} x {self.filter}")

    @property
    def size(self) -> int:
        return self.channel * self.filter

    def position(self, rank: int) -> tuple[int, int]:
        """``(ic, if)`` of group rank ``rank``."""
        if not 0 <= rank < self.size:
            raise ValueError(f"group rank {rank} outside a group of {self.size}")
        return divmod(rank, self.filter)


def algorithm_factor(algorithm: str, grid: Factor) -> Factor:
    """The factorisation an algorithm uses on the grid's channel/filter group."""
    if algorithm == "x":
        return Factor(grid.size, 1)
    if algorithm == "y":
        return Factor(1, grid.size)
    if algorithm == "w":
        return grid
    raise ValueError(f"unknown channel algorithm {algorithm!r}; expected one of "
                     f"{', '.join(ALGORITHMS)}")


def fine_block(n: int, groups: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of fine block ``index`` of ``n`` channels over ``groups`` ranks."""
    return block_range(n, groups, index)


@dataclass(frozen=True)
class ChannelBlocks:
    """Group rank ``rank``'s share of one convolution under ``factor``."""

    in_channels: int
    out_channels: int
    factor: Factor
    rank: int

    @property
    def channel_pos(self) -> int:
        return self.factor.position(self.rank)[0]

    @property
    def filter_pos(self) -> int:
        return self.factor.position(self.rank)[1]

    def input_pieces(self) -> list[int]:
        """Fine-block sizes the all-gather over my ``f`` ranks concatenates (rank order)."""
        f, size = self.factor.filter, self.factor.size
        return [_length(fine_block(self.in_channels, size, self.channel_pos * f + k)) for k in range(f)]

    def input_channels(self) -> tuple[int, int]:
        """``C_ic``: the contiguous input channels my weight block reads."""
        f, size = self.factor.filter, self.factor.size
        start = fine_block(self.in_channels, size, self.channel_pos * f)[0]
        return start, fine_block(self.in_channels, size, self.channel_pos * f + f - 1)[1]

    def output_pieces(self) -> list[int]:
        """Fine-block sizes the reduce-scatter over my ``c`` ranks hands out (rank order)."""
        f, size = self.factor.filter, self.factor.size
        return [_length(fine_block(self.out_channels, size, k * f + self.filter_pos))
                for k in range(self.factor.channel)]

    def filter_rows(self) -> np.ndarray:
        """``F_if``: my weight block's filters, in the order of :meth:`output_pieces`."""
        f, size = self.factor.filter, self.factor.size
        ranges = [fine_block(self.out_channels, size, k * f + self.filter_pos)
                  for k in range(self.factor.channel)]
        return np.concatenate([np.arange(a, b) for a, b in ranges]).astype(np.intp)

    def output_block(self) -> tuple[int, int]:
        """My fine block of the output channels (where the reduce-scatter leaves me)."""
        return fine_block(self.out_channels, self.factor.size, self.rank)

    def weight_index(self) -> tuple[np.ndarray, slice]:
        """Index of my block in the full ``F x C x k x k x k`` weight."""
        return self.filter_rows(), slice(*self.input_channels())


def _length(block: tuple[int, int]) -> int:
    return block[1] - block[0]


def comm_volume(in_channels: int, out_channels: int, in_elems: float, out_elems: float,
                halo_elems: float, factor: Factor, input_grad: bool = True) -> float:
    """Elements one rank moves per step (forward + backward) in a convolution, on average.

    ``in_elems`` / ``out_elems`` are the rank's input / output elements *per channel*
    (local samples x spatial block) and ``halo_elems`` the halo elements per channel it
    receives.  With ``G = c * f`` ranks, each holding ``1/G`` of the channels, and
    ``b = 1`` when the layer computes ``dL/dx`` (``b = 0`` for the first layer)::

        V(c, f) = 1/G * [ (1 + b) (f - 1) C S_x    all-gather x, reduce-scatter dL/dx
                        +  2      (c - 1) F S_y    reduce-scatter y, all-gather dL/dy
                        + (1 + b)  f      C H_x ]  halos of the gathered input

    Counted as what a rank receives in an all-gather and sends in a reduce-scatter (the
    data that must cross the network whatever the collective's implementation); summed
    over the group it is exact for any block sizes, since the ``f`` ranks sharing a
    channel block ``C_ic`` each gather the ``|C_ic|`` channels less their own.
    """
    c, f, g = factor.channel, factor.filter, factor.size
    both = 2.0 if input_grad else 1.0
    gathered = both * (f - 1) * in_channels * in_elems
    scattered = 2.0 * (c - 1) * out_channels * out_elems
    halos = both * f * in_channels * halo_elems
    return (gathered + scattered + halos) / g


def choose_algorithm(in_channels: int, out_channels: int, in_elems: float, out_elems: float,
                     halo_elems: float, grid: Factor, input_grad: bool = True) -> str:
    """The algorithm of least :func:`comm_volume` (ties: x, then y, then w)."""
    volumes = {alg: comm_volume(in_channels, out_channels, in_elems, out_elems, halo_elems,
                                algorithm_factor(alg, grid), input_grad)
               for alg in ALGORITHMS}
    return min(ALGORITHMS, key=lambda alg: volumes[alg])


def halo_elements(block: Sequence[float], kernel: Sequence[int],
                  ways: Sequence[int]) -> float:
    """Halo elements per channel a rank receives around its spatial ``block``, on average.

    Margins are ``k // 2`` planes on each side that has a neighbour: ``2 (w - 1) / w``
    sides per split dimension on average (exact for 2-way splits), edges and corners
    included through the product.
    """
    grown = [b + 2 * (k // 2) * (w - 1) / w for b, k, w in zip(block, kernel, ways)]
    return float(np.prod(grown) - np.prod(block))
