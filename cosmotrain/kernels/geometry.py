"""Shape arithmetic shared by the convolution and pooling kernels (pure, no data).

Padding is *asymmetric*: one ``(lo, hi)`` pair per spatial dimension, because the
distributed layers call a kernel on a block that already carries halo margins on the
sides that have neighbours (padding 0 there) and needs the true zero padding only on the
global boundary.  Every kernel normalises its arguments through :func:`normalize_padding`
and :func:`normalize_triple`, so callers may also pass an int or three ints.
:class:`ConvGeometry` validates a convolution's shapes once; :func:`plan_chunks` cuts
each sample's output depth planes into the kernels' units of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

import numpy as np

Triple = Tuple[int, int, int]
Padding = Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]
Chunk = Tuple[int, int, int]  # (sample, first plane, end plane)
PaddingLike = Union[int, Sequence[int], Sequence[Sequence[int]]]


def normalize_triple(value: Union[int, Sequence[int]], name: str) -> Triple:
    """Return ``(d, h, w)`` from an int or a sequence of three positive ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        vals = (value,) * 3
    else:
        vals = tuple(value)  # type: ignore[arg-type]
        if len(vals) != 3:
            raise ValueError(f"{name} must be an int or 3 ints, got {value!r}")
    if any(isinstance(v, bool) or not hasattr(v, "__index__") for v in vals):
        raise ValueError(f"{name} must contain ints, got {value!r}")
    vals = tuple(int(v) for v in vals)
    if min(vals) < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return vals  # type: ignore[return-value]


def normalize_padding(padding: PaddingLike) -> Padding:
    """Return ``((lo, hi),) * 3`` from an int, 3 ints, or 3 ``(lo, hi)`` pairs.

    ``1`` -> ``((1, 1), (1, 1), (1, 1))``; ``(0, 1, 2)`` -> symmetric per dimension;
    ``((1, 0), (0, 2), (2, 1))`` is taken as is.  Negative values are rejected.
    """
    if isinstance(padding, int) and not isinstance(padding, bool):
        pairs = [(padding, padding)] * 3
    else:
        items = list(padding)  # type: ignore[arg-type]
        if len(items) != 3:
            raise ValueError(f"padding must be an int, 3 ints or 3 (lo, hi) pairs, got {padding!r}")
        pairs = []
        for item in items:
            if hasattr(item, "__index__"):
                pairs.append((int(item), int(item)))
            else:
                pair = tuple(item)
                if len(pair) != 2:
                    raise ValueError(f"padding pair must be (lo, hi), got {item!r} in {padding!r}")
                pairs.append((int(pair[0]), int(pair[1])))
    if any(v < 0 for pair in pairs for v in pair):
        raise ValueError(f"padding must be >= 0, got {padding!r}")
    return tuple(pairs)  # type: ignore[return-value]


def output_size(size: int, k: int, stride: int, lo: int, hi: int) -> int:
    """``(size + lo + hi - k) // stride + 1`` (0 or less means the window does not fit)."""
    return (size + lo + hi - k) // stride + 1


def output_shape(spatial: Sequence[int], kernel: Triple, stride: Triple, padding: Padding,
                 what: str = "input") -> Triple:
    """Output ``(Do, Ho, Wo)``; ``ValueError`` if the padded input is smaller than the kernel."""
    out = tuple(output_size(n, k, s, lo, hi)
                for n, k, s, (lo, hi) in zip(spatial, kernel, stride, padding))
    if min(out) < 1:
        raise ValueError(
            f"{what} spatial shape {tuple(spatial)} with padding {padding} is smaller than "
            f"the kernel {tuple(kernel)}")
    return out  # type: ignore[return-value]


def check_batch_shape(x_shape: Tuple[int, ...]) -> None:
    """Reject anything but ``(N, C, D, H, W)`` with ``N >= 0`` and positive C, D, H, W.

    ``N = 0`` is valid: a sample group holding no sample of a short batch still runs
    every layer (its halo exchanges and collectives pair with the other ranks'), and the
    kernels answer it with empty results (zero weight gradients) before any compute.
    """
    if len(x_shape) != 5 or x_shape[0] < 0 or min(x_shape[1:]) < 1:
        raise ValueError(f"x shape must be (N, C, D, H, W) with N >= 0 and positive "
                         f"C, D, H, W, got {x_shape}")


@dataclass(frozen=True)
class ConvGeometry:
    """Everything shape-related about one 3D convolution (validated on construction)."""

    batch: int
    channels: int
    filters: int
    spatial: Triple        # input (D, H, W), without padding
    kernel: Triple
    stride: Triple
    padding: Padding
    out: Triple            # output (Do, Ho, Wo)

    @classmethod
    def create(cls, x_shape: Sequence[int], w_shape: Sequence[int],
               stride: "int | Sequence[int]", padding: PaddingLike) -> "ConvGeometry":
        """Validate shapes; the ``ValueError`` names the offending argument."""
        x_shape, w_shape = tuple(int(v) for v in x_shape), tuple(int(v) for v in w_shape)
        check_batch_shape(x_shape)
        if len(w_shape) != 5 or min(w_shape) < 1:
            raise ValueError(
                f"w shape must be (F, C, kD, kH, kW) with positive sizes, got {w_shape}")
        if x_shape[1] != w_shape[1]:
            raise ValueError(f"x has {x_shape[1]} channels but w expects {w_shape[1]} "
                             f"(x shape {x_shape}, w shape {w_shape})")
        kernel = w_shape[2:]
        stride, padding = normalize_triple(stride, "stride"), normalize_padding(padding)
        out = output_shape(x_shape[2:], kernel, stride, padding, what="x")
        return cls(x_shape[0], x_shape[1], w_shape[0], x_shape[2:], kernel, stride, padding, out)

    @property
    def x_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.channels) + self.spatial

    @property
    def w_shape(self) -> Tuple[int, ...]:
        return (self.filters, self.channels) + self.kernel

    @property
    def y_shape(self) -> Tuple[int, ...]:
        return (self.batch, self.filters) + self.out

    @property
    def rows(self) -> int:
        """Rows of the column matrix: ``C * kD * kH * kW``."""
        return self.channels * int(np.prod(self.kernel))

    @property
    def plane(self) -> int:
        """Output positions in one output depth plane."""
        return self.out[1] * self.out[2]

    def slab_shape(self, planes: int) -> Tuple[int, int, int, int]:
        """Padded input slab ``(C, depth, Hp, Wp)`` read by ``planes`` output planes."""
        (sd, sh, sw), (_, ho, wo) = self.stride, self.out
        kd, kh, kw = self.kernel
        return (self.channels, (planes - 1) * sd + kd, (ho - 1) * sh + kh, (wo - 1) * sw + kw)

    def check(self, name: str, shape: Sequence[int], expected: Sequence[int]) -> None:
        if tuple(shape) != tuple(expected):
            raise ValueError(f"{name} shape {tuple(shape)} does not match the convolution "
                             f"(x {self.x_shape}, w {self.w_shape}, stride {self.stride}, "
                             f"padding {self.padding}): expected {tuple(expected)}")


def plan_chunks(batch: int, depth: int, planes: int, min_planes: int = 1) -> List[Chunk]:
    """Split each sample's ``depth`` planes into runs of about ``planes`` planes.

    Run lengths are evened out; all runs but the last of a sample have at least
    ``min_planes`` planes.
    """
    planes = max(min_planes, min(depth, planes))
    count = -(-depth // planes)
    planes = max(min_planes, -(-depth // count))
    return [(n, d0, min(depth, d0 + planes)) for n in range(batch)
            for d0 in range(0, depth, planes)]
