"""Regression losses as *sums* over a local block, with the global count given.

A distributed loss divides by the global number of elements, not the local one, so that
the mean (and hence every gradient) is the same at every rank count.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.backend import array_module


def mse_sum(pred: Any, target: Any) -> float:
    diff = (pred - target).astype(array_module(pred).float64)
    return float((diff * diff).sum())


def mse_backward(pred: Any, target: Any, total_count: int) -> Any:
    """d/dpred of sum((pred - target)^2) / total_count."""
    return (pred - target) * pred.dtype.type(2.0 / total_count)


def mae_sum(pred: Any, target: Any) -> float:
    return float(abs(pred - target).astype(array_module(pred).float64).sum())


def mae_backward(pred: Any, target: Any, total_count: int) -> Any:
    """d/dpred of sum(|pred - target|) / total_count (sign, 0 at a tie)."""
    xp = array_module(pred)
    return xp.sign(pred - target) * pred.dtype.type(1.0 / total_count)
