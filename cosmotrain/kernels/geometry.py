"""Shape arithmetic shared by the convolution and pooling kernels (pure, no arrays).

Padding is *asymmetric*: one ``(lo, hi)`` pair per spatial dimension, because the
distributed layers call a kernel on a block that already carries halo margins on the
sides that have neighbours (padding 0 there) and needs the true zero padding only on the
global boundary.  Every kernel normalises its arguments through :func:`normalize_padding`
and :func:`normalize_triple`, so callers may also pass an int or three ints.
"""

from __future__ import annotations

from typing import Sequence, Tuple, Union

Triple = Tuple[int, int, int]
Padding = Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]
PaddingLike = Union[int, Sequence[int], Sequence[Sequence[int]]]


def normalize_triple(value: Union[int, Sequence[int]], name: str) -> Triple:
    """Return ``(d, h, w)`` from an int or a sequence of three positive ints."""
    if isinstance(value, (int,)) and not isinstance(value, bool):
        vals = (value,) * 3
    else:
        vals = tuple(value)  # type: ignore[arg-type]
        if len(vals) != 3:
            raise ValueError(f"{name} must be an int or 3 ints, got {value!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) or hasattr(v, "__index__")
               for v in vals):
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


def used_extent(out: int, k: int, stride: int) -> int:
    """Padded input extent that the windows of ``out`` outputs actually read.

    With stride > 1 the last few padded input planes may be read by no window; they get
    zero gradient.
    """
    return (out - 1) * stride + k
