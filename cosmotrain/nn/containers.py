"""Composition: a sequence of layers and a residual block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosmotrain.nn.module import Context, Layer

# A layer followed by a LeakyReLU may apply it to its own output (Layer.take_activation):
# convolutions then do it in their kernels' output loops, saving the activation's pass
# (paper network, batch 1: act1's 8.5 ms forward); and a first convolution may run its
# backward (Layer.take_activation_grad) in its filter gradient's packing of dy (act1's
# 10 ms backward), and an average pooling may run the backward of the LeakyReLU before it
# as it writes its own gradient (Layer.take_preceding_activation: act2, act3).  False:
# every activation makes its own passes (A/B runs; the results are the same bits,
# tests/test_fused_activation.py).
FUSE_ACTIVATIONS = True


@dataclass
class Sequential(Layer):
    """Layers applied in order; backward runs them in reverse.

    Each layer's gradients are reported to ``ctx.on_grad_ready`` as soon as its backward
    returns, which is what lets gradient reductions overlap the rest of backward.
    """

    items: list[Layer] = field(default_factory=list)

    def _propagate_input_grad(self) -> None:
        """The first layer needs an input gradient exactly when this sequence does."""
        if self.items:
            self.items[0].needs_input_grad = self.needs_input_grad

    def children(self) -> list[Layer]:
        return list(self.items)

    def forward(self, x: Any, ctx: Context) -> Any:
        self._propagate_input_grad()
        for layer, follower in zip(self.items, self.items[1:] + [None]):
            slope = follower.activation_slope() if follower is not None else None
            applied = layer.take_activation(slope if FUSE_ACTIVATIONS else None)
            if follower is not None:
                follower.set_applied_by_previous(applied)
            x = layer.forward(x, ctx)
        return x

    def backward(self, dy: Any, ctx: Context) -> Any:
        for index in range(len(self.items) - 1, -1, -1):
            layer = self.items[index]
            if index and FUSE_ACTIVATIONS:
                if layer.hand_over_backward(self.items[:index]):
                    continue  # a layer before runs this backward
                layer.take_preceding_activation(self.items[:index])
            dy = layer.backward(dy, ctx)
            if ctx.on_grad_ready is not None and layer.params:
                ctx.on_grad_ready(layer)
        return dy

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        for layer in self.items:
            shape = layer.output_shape(shape)
        return shape

    def __getitem__(self, name: str) -> Layer:
        for layer in self.items:
            if layer.name == name:
                return layer
        raise KeyError(name)


@dataclass
class Residual(Layer):
    """``post(body(x) + shortcut(x))``, torchvision-style names.

    The body's layers are named directly under the block (``layer1.0.conv1.weight``) and
    the projection shortcut, when there is one, is ``downsample`` (``layer1.0.downsample.0
    .weight``), exactly as in torchvision's ResNet blocks.
    """

    body: Sequential = field(default_factory=Sequential)
    shortcut: Sequential | None = None
    post: Layer | None = None

    def children(self) -> list[Layer]:
        found: list[Layer] = [self.body]
        if self.shortcut is not None:
            found.append(self.shortcut)
        if self.post is not None:
            found.append(self.post)
        return found

    def forward(self, x: Any, ctx: Context) -> Any:
        self.body.needs_input_grad = True
        y = self.body.forward(x, ctx)
        y += self.shortcut.forward(x, ctx) if self.shortcut is not None else x
        return self.post.forward(y, ctx) if self.post is not None else y

    def backward(self, dy: Any, ctx: Context) -> Any:
        if self.post is not None:
            dy = self.post.backward(dy, ctx)
        if self.shortcut is not None:
            dx_short = self.shortcut.backward(dy, ctx)
        else:
            dx_short = dy.copy() if self.needs_input_grad else None
        dx = self.body.backward(dy, ctx)
        if not self.needs_input_grad:
            return None
        dx += dx_short
        return dx

    def output_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.body.output_shape(shape)
