"""Build the ``torch.nn`` twin of a cosmotrain network (tests and benchmarks only).

The twin is made of stock torch modules registered under cosmotrain's layer names, and
cosmotrain's parameters are loaded into it with ``load_state_dict(strict=True)``: that is
the check that our names and layouts are PyTorch's.  torch is never a dependency of
cosmotrain itself.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from cosmotrain.nn import layers as L
from cosmotrain.nn.containers import Residual, Sequential
from cosmotrain.nn.module import Layer


class TorchResidual(nn.Module):
    """post(body(x) + shortcut(x)) with the body's layers registered directly."""

    def __init__(self, block: Residual) -> None:
        super().__init__()
        self.order = [layer.name for layer in block.body.items]
        for layer in block.body.items:
            self.add_module(layer.name, mirror(layer))
        self.downsample = mirror(block.shortcut) if block.shortcut is not None else None
        self.post = mirror(block.post) if block.post is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for name in self.order:
            y = getattr(self, name)(y)
        y = y + (self.downsample(x) if self.downsample is not None else x)
        return self.post(y)


class TorchSequential(nn.Module):
    def __init__(self, seq: Sequential) -> None:
        super().__init__()
        self.order = []
        for layer in seq.items:
            self.add_module(layer.name, mirror(layer))
            self.order.append(layer.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            x = getattr(self, name)(x)
        return x


class CountPadAvgPool(nn.Module):
    """AvgPool3d with zero padding counted; pads explicitly when torch's native pool
    would reject an input smaller than the kernel (the result is the same)."""

    def __init__(self, kernel, stride, padding) -> None:
        super().__init__()
        self.native = nn.AvgPool3d(kernel, stride, padding, count_include_pad=True)
        self.unpadded = nn.AvgPool3d(kernel, stride, 0)
        self.kernel, self.padding = kernel, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if all(s >= k for s, k in zip(x.shape[2:], self.kernel)):
            return self.native(x)
        p = self.padding
        return self.unpadded(nn.functional.pad(x, (p[2], p[2], p[1], p[1], p[0], p[0])))


class ScaledTanh(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * torch.tanh(x)


def mirror(layer: Layer) -> nn.Module:
    """The torch module equivalent to one cosmotrain layer (recursively)."""
    if isinstance(layer, Sequential):
        return TorchSequential(layer)
    if isinstance(layer, Residual):
        return TorchResidual(layer)
    if isinstance(layer, L.Conv3d):
        return nn.Conv3d(layer.in_channels, layer.out_channels, layer.kernel, layer.stride,
                         tuple(p[0] for p in layer.padding), bias=layer.bias)
    if isinstance(layer, L.Pool3d):
        pad = tuple(p[0] for p in layer.padding)
        if layer.mode == "avg":
            return CountPadAvgPool(layer.kernel, layer.stride, pad)
        return nn.MaxPool3d(layer.kernel, layer.stride, pad)
    if isinstance(layer, L.BatchNorm3d):
        return nn.BatchNorm3d(layer.channels, eps=layer.eps, momentum=layer.momentum)
    if isinstance(layer, L.LeakyReLU):
        return nn.LeakyReLU(layer.slope)
    if isinstance(layer, L.Linear):
        return nn.Linear(layer.in_features, layer.out_features, bias="bias" in layer.params)
    if isinstance(layer, L.Flatten):
        return nn.Flatten()
    if isinstance(layer, L.GlobalAvgPool):
        return nn.AdaptiveAvgPool3d(1)
    if isinstance(layer, L.ScaledTanh):
        return ScaledTanh(layer.scale)
    if isinstance(layer, L.Dropout):
        return nn.Identity()  # comparisons run with dropout off; masks are tested apart
    raise TypeError(f"no torch twin for {type(layer).__name__}")


def state_dict_of(model: Layer) -> dict[str, torch.Tensor]:
    """cosmotrain parameters and buffers as a torch state dict (same keys)."""
    state = {name: torch.from_numpy(np.array(p.data)) for name, p in model.named_parameters()}
    for name, owner, key in model.named_buffers():
        state[name] = torch.as_tensor(np.array(owner.buffers[key]))
    return state


def torch_twin(model: Layer, activation_first: bool = False) -> nn.Module:
    """The ``torch.nn`` twin with the same weights; ``activation_first``: each max-pool
    followed by a LeakyReLU runs after it instead, as the MLPerf reference (and a PyTorch
    user) writes the block (cosmotrain builds it pooled first: the same function)."""
    twin = mirror(model)
    twin.load_state_dict(state_dict_of(model), strict=True)
    if activation_first:
        twin.order = activation_first_order(twin)
    return twin


def activation_first_order(seq: TorchSequential) -> list[str]:
    """``seq.order`` with every (MaxPool3d, LeakyReLU) pair swapped."""
    order = list(seq.order)
    for i in range(len(order) - 1):
        first, second = getattr(seq, order[i]), getattr(seq, order[i + 1])
        if isinstance(first, nn.MaxPool3d) and isinstance(second, nn.LeakyReLU):
            order[i], order[i + 1] = order[i + 1], order[i]
    return order
