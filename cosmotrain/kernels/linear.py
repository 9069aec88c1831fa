"""Fully connected layer, PyTorch layout: weight (out, in), y = x @ W^T + b."""

from __future__ import annotations

from typing import Any


def linear_forward(x: Any, weight: Any, bias: Any | None) -> Any:
    y = x @ weight.T
    if bias is not None:
        y += bias
    return y


def linear_backward_data(dy: Any, weight: Any) -> Any:
    return dy @ weight


def linear_backward_weight(x: Any, dy: Any) -> tuple[Any, Any]:
    """(dW, db) for this block of samples (to be summed over the sample replicas)."""
    return dy.T @ x, dy.sum(axis=0)
