"""A 3D ResNet (torchvision's ResNet adapted to volumes) regressing CosmoFlow's parameters.

Stem: conv k3 s1 -> BN -> ReLU (CosmoFlow cubes are small; no max-pool).  Four stages of
basic (two k3 convs) or bottleneck (1-3-1, expansion 4) blocks with ``base``, 2x, 4x, 8x
channels, stride 2 at the start of stages 2-4, projection shortcuts where the shape
changes; global average pool -> fc.  Names follow torchvision (``layer2.0.downsample.0``).
With ``batchnorm`` off, convolutions get biases instead of BN layers.
"""

from __future__ import annotations

from cosmotrain.nn import factory
from cosmotrain.nn.containers import Residual, Sequential
from cosmotrain.nn.init import Initializer, constant, glorot_uniform, he_normal_fan_out
from cosmotrain.nn.layers import Flatten, GlobalAvgPool, LeakyReLU
from cosmotrain.nn.module import Layer

STAGE_BLOCKS = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3),
                101: (3, 4, 23, 3)}
EXPANSION = {"basic": 1, "bottleneck": 4}


def _conv_norm(prefix: str, index: int, cin: int, cout: int, kernel: int, stride: int,
               batchnorm: bool) -> list[Layer]:
    """conv{index} (+ bn{index}); a conv without BN gets a bias."""
    pad = kernel // 2
    layers: list[Layer] = [factory.conv(f"{prefix}conv{index}", cin, cout, kernel, stride, pad,
                                        bias=not batchnorm)]
    if batchnorm:
        layers.append(factory.batchnorm(f"{prefix}bn{index}", cout))
    return layers


def _block(name: str, kind: str, cin: int, width: int, stride: int, batchnorm: bool
           ) -> Residual:
    cout = width * EXPANSION[kind]
    if kind == "basic":
        shapes = [(cin, width, 3, stride), (width, cout, 3, 1)]
    else:
        shapes = [(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)]
    body: list[Layer] = []
    for i, (a, b, k, s) in enumerate(shapes, start=1):
        body += _conv_norm("", i, a, b, k, s, batchnorm)
        if i < len(shapes):
            body.append(LeakyReLU(name=f"relu{i}", slope=0.0))
    shortcut = None
    if stride != 1 or cin != cout:
        down: list[Layer] = [factory.conv("0", cin, cout, 1, stride, 0, bias=not batchnorm)]
        if batchnorm:
            down.append(factory.batchnorm("1", cout))
        shortcut = Sequential(name="downsample", items=down)
    return Residual(name=name, body=Sequential(name="", items=body), shortcut=shortcut,
                    post=LeakyReLU(name="relu", slope=0.0))


def build_resnet3d(width: int, channels: int = 4, outputs: int = 4, depth: int = 18,
                   block: str = "basic", base: int = 16, batchnorm: bool = True) -> Sequential:
    layers: list[Layer] = _conv_norm("", 1, channels, base, 3, 1, batchnorm)
    layers.append(LeakyReLU(name="relu", slope=0.0))
    cin = base
    for stage, blocks in enumerate(STAGE_BLOCKS[depth], start=1):
        stage_width = base * 2 ** (stage - 1)
        items = []
        for b in range(blocks):
            stride = 2 if stage > 1 and b == 0 else 1
            items.append(_block(str(b), block, cin, stage_width, stride, batchnorm))
            cin = stage_width * EXPANSION[block]
        layers.append(Sequential(name=f"layer{stage}", items=items))
    layers += [GlobalAvgPool(name="avgpool"), Flatten(name="flatten"),
               factory.linear("fc", cin, outputs)]
    return Sequential(name="", items=layers, needs_input_grad=False)


def resnet3d_init(name: str) -> Initializer:
    """torchvision: Kaiming-normal (fan-out) convs, BN weight 1 / bias 0, fc Glorot, 0 bias."""
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    is_bn = parent.startswith("bn") or (parent == "1" and "downsample" in name)
    if is_bn:
        return constant(1.0) if leaf == "weight" else constant(0.0)
    if name.startswith("fc."):
        return glorot_uniform if leaf == "weight" else constant(0.0)
    return he_normal_fan_out if leaf == "weight" else constant(0.0)
