"""The CosmoFlow network of LBANN / Oyama et al. (REFERENCE.md), the default model.

Seven k3 p1 convolutions without bias (conv4 has stride 2), each followed by optional
batch norm and LeakyReLU; conv1-5 are each followed by a k3 s2 p1 average pool (padding
counted), conv6 only when W >= 256 and conv7 only when W >= 512, so the final volume is
256 x 2^3 = 2048 at W = 128, 256 and 512 and the network has 9,437,636 parameters there.
Then dropout -> fc1 (-> 2048) -> LeakyReLU -> dropout -> fc2 (2048 -> 256) -> LeakyReLU ->
dropout -> fc3 (256 -> 4).  Weights are Glorot-uniform and linear biases 0.1, as in LBANN.
"""

from __future__ import annotations

from cosmotrain.kernels.geometry import normalize_padding
from cosmotrain.nn import factory
from cosmotrain.nn.containers import Sequential
from cosmotrain.nn.init import Initializer, constant, glorot_uniform
from cosmotrain.nn.layers import Dropout, Flatten, LeakyReLU, Pool3d
from cosmotrain.nn.module import Layer

CONV_CHANNELS = (16, 32, 64, 128, 256, 256, 256)
CONV_STRIDES = (1, 1, 1, 2, 1, 1, 1)
DEFAULT_SLOPE = 0.01


def pooled_after(index: int, width: int) -> bool:
    """Whether conv ``index`` (1-based) is followed by an average pool at input ``width``."""
    return index <= 5 or (index == 6 and width >= 256) or (index == 7 and width >= 512)


def build_cosmoflow(width: int, channels: int = 4, outputs: int = 4, dropout: float = 0.0,
                    batchnorm: bool = False, slope: float = DEFAULT_SLOPE) -> Sequential:
    layers: list[Layer] = []
    cin = channels
    for i, (cout, stride) in enumerate(zip(CONV_CHANNELS, CONV_STRIDES), start=1):
        layers.append(factory.conv(f"conv{i}", cin, cout, 3, stride, 1))
        if batchnorm:
            layers.append(factory.batchnorm(f"bn{i}", cout))
        layers.append(LeakyReLU(name=f"act{i}", slope=slope))
        if pooled_after(i, width):
            layers.append(Pool3d(name=f"pool{i}", mode="avg", kernel=(3, 3, 3),
                                 stride=(2, 2, 2), padding=normalize_padding(1)))
        cin = cout
    flat = Sequential(items=list(layers)).output_shape((1, channels, width, width, width))
    features = flat[1] * flat[2] * flat[3] * flat[4]
    head: list[Layer] = [Flatten(name="flatten")]
    for i, (fin, fout) in enumerate([(features, 2048), (2048, 256), (256, outputs)], start=1):
        if dropout > 0:
            head.append(Dropout(name=f"drop{i}", p=dropout))
        head.append(factory.linear(f"fc{i}", fin, fout))
        if i < 3:
            head.append(LeakyReLU(name=f"act_fc{i}", slope=slope))
    return Sequential(name="", items=layers + head, needs_input_grad=False)


def cosmoflow_init(name: str) -> Initializer:
    """LBANN: Glorot-uniform weights, linear biases 0.1 (batch norm: weight 1, bias 0)."""
    if name.startswith("bn"):
        return constant(1.0) if name.endswith("weight") else constant(0.0)
    return glorot_uniform if name.endswith("weight") else constant(0.1)
