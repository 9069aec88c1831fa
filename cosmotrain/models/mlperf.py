"""The MLPerf HPC CosmoFlow reference network (REFERENCE.md, ``cosmoflow-mlperf``).

Five [conv k3 'same' (32, 64, 128, 256, 512 filters, with bias) -> LeakyReLU(0.3) ->
max-pool 2] blocks, flatten (32,768 at 128^3) -> fc1 128 -> LeakyReLU -> dropout -> fc2 64
-> LeakyReLU -> dropout -> fc3 4 -> 1.2 * tanh.  8,907,556 parameters at W = 128.
Keras defaults: Glorot-uniform weights, zero biases.

Each block is built as conv -> max-pool -> LeakyReLU, the same function for a slope >= 0
(a negative slope keeps the reference order): LeakyReLU is then non-decreasing and so is
its float32 rounding, so the maximum of the activated window is the activation of the
window's maximum, bit for bit, NaN included.  Pooling first activates 1/8 of the
elements, and the full-resolution activation is never kept for backward (the pool keeps
its int8 argmax): on conv1 at W=128 that removes two passes over 32 x 128^3 floats per
sample and 256 MiB of saved activation (docs/PERFORMANCE.md, "cosmoflow-mlperf step").
The gradient is the reference order's too, except where float32 rounding makes two
different negative inputs of a window activate to the same value: the reference order
then routes the gradient to the first of them, this order to the larger
(tests/test_models.py compares both orders against PyTorch).
"""

from __future__ import annotations

from cosmotrain.kernels.geometry import normalize_padding
from cosmotrain.nn import factory
from cosmotrain.nn.containers import Sequential
from cosmotrain.nn.init import Initializer, constant, glorot_uniform
from cosmotrain.nn.layers import Dropout, Flatten, LeakyReLU, Pool3d, ScaledTanh
from cosmotrain.nn.module import Layer

CONV_CHANNELS = (32, 64, 128, 256, 512)
DEFAULT_SLOPE = 0.3


def build_mlperf(width: int, channels: int = 4, outputs: int = 4, dropout: float = 0.0,
                 batchnorm: bool = False, slope: float = DEFAULT_SLOPE) -> Sequential:
    layers: list[Layer] = []
    cin = channels
    for i, cout in enumerate(CONV_CHANNELS, start=1):
        layers.append(factory.conv(f"conv{i}", cin, cout, 3, 1, 1, bias=not batchnorm))
        if batchnorm:
            layers.append(factory.batchnorm(f"bn{i}", cout))
        pool = Pool3d(name=f"pool{i}", mode="max", kernel=(2, 2, 2), stride=(2, 2, 2),
                      padding=normalize_padding(0))
        act = LeakyReLU(name=f"act{i}", slope=slope)
        layers += [pool, act] if slope >= 0 else [act, pool]  # see the module docstring
        cin = cout
    flat = Sequential(items=list(layers)).output_shape((1, channels, width, width, width))
    features = flat[1] * flat[2] * flat[3] * flat[4]
    head: list[Layer] = [Flatten(name="flatten")]
    for i, (fin, fout) in enumerate([(features, 128), (128, 64)], start=1):
        head += [factory.linear(f"fc{i}", fin, fout), LeakyReLU(name=f"act_fc{i}", slope=slope)]
        if dropout > 0:
            head.append(Dropout(name=f"drop{i}", p=dropout))
    head += [factory.linear("fc3", 64, outputs), ScaledTanh(name="out", scale=1.2)]
    return Sequential(name="", items=layers + head, needs_input_grad=False)


def mlperf_init(name: str) -> Initializer:
    if name.startswith("bn"):
        return constant(1.0) if name.endswith("weight") else constant(0.0)
    return glorot_uniform if name.endswith("weight") else constant(0.0)
