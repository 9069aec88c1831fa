"""A tiny network for tests: every layer kind of the real models, in milliseconds.

conv1 (k3 p1) -> [bn1] -> LeakyReLU -> avg-pool k3 s2 p1 -> conv2 (k3 s2 p1, asymmetric
halos) -> [bn2] -> LeakyReLU -> max-pool 2 -> flatten -> [dropout] -> fc1 16 -> LeakyReLU ->
fc2 outputs.
"""

from __future__ import annotations

from cosmotrain.kernels.geometry import normalize_padding
from cosmotrain.nn import factory
from cosmotrain.nn.containers import Sequential
from cosmotrain.nn.init import Initializer, constant, glorot_uniform
from cosmotrain.nn.layers import Dropout, Flatten, LeakyReLU, Pool3d
from cosmotrain.nn.module import Layer

DEFAULT_SLOPE = 0.01


def build_tiny(width: int, channels: int = 4, outputs: int = 4, dropout: float = 0.0,
               batchnorm: bool = False, slope: float = DEFAULT_SLOPE) -> Sequential:
    layers: list[Layer] = []
    for i, (cin, cout, stride) in enumerate([(channels, 4, 1), (4, 8, 2)], start=1):
        layers.append(factory.conv(f"conv{i}", cin, cout, 3, stride, 1))
        if batchnorm:
            layers.append(factory.batchnorm(f"bn{i}", cout))
        layers.append(LeakyReLU(name=f"act{i}", slope=slope))
        mode, kernel, pstride, pad = ("avg", 3, 2, 1) if i == 1 else ("max", 2, 2, 0)
        layers.append(Pool3d(name=f"pool{i}", mode=mode, kernel=(kernel,) * 3,
                             stride=(pstride,) * 3, padding=normalize_padding(pad)))
    flat = Sequential(items=list(layers)).output_shape((1, channels, width, width, width))
    features = flat[1] * flat[2] * flat[3] * flat[4]
    head: list[Layer] = [Flatten(name="flatten")]
    if dropout > 0:
        head.append(Dropout(name="drop1", p=dropout))
    head += [factory.linear("fc1", features, 16), LeakyReLU(name="act_fc1", slope=slope),
             factory.linear("fc2", 16, outputs)]
    return Sequential(name="", items=layers + head, needs_input_grad=False)


def tiny_init(name: str) -> Initializer:
    if name.startswith("bn"):
        return constant(1.0) if name.endswith("weight") else constant(0.0)
    return glorot_uniform if name.endswith("weight") else constant(0.1)
