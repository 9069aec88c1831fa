"""The compulsory memory traffic of one training step, from the layer shapes alone.

Why: issue 35's byte budget holds the bytes a GPU step's launches move (counted by the
stand-in cupy, tests/standin_bytes.py) against what the step cannot avoid moving.  This
module derives the latter independently of the ledger and of the engine, from the
networks' published shapes (models/cosmoflow.py, models/mlperf.py docstrings); the
derivation and its figures are in docs/PERFORMANCE.md, "GPU: compulsory traffic".

The rules, those of a step whose epilogues are fused (issue 35's notes on the GPU step):
every tensor is written once and read once by each pass that needs it.

* convolution forward reads its input, writes its output with the bias and, where the
  activation comes next, the LeakyReLU in its epilogue;
* an average pool reads its input and writes its output; a max pool (MLPerf: pool, then
  LeakyReLU) also writes its int8 argmax and applies the activation on the way out;
* backward: a pool's backward reads the output gradient and writes its input gradient,
  the activation's backward fused into it, reading the activation (the mask) once; an
  activation no pool follows has its backward fused into the next layer's data
  gradient, which reads the mask once; a convolution's data gradient reads dy and
  writes dx (none for the first layer), its weight gradient reads x and dy (the bias
  gradient is a by-product);
* dropout is fused (its mask is regenerated from the seed), flatten is a view, the loss
  and the output's tanh move a few bytes per sample;
* per step, not per sample: weights read by forward and data gradient in the storage
  dtype, weight gradients written in it, and SGD with momentum reading the float32
  master weights, the gradient and the momentum, writing weights and momentum (and the
  bf16 copy of the weights in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

KERNEL = 27  # 3 x 3 x 3
MASTER = 4  # float32 master weights and optimizer state


@dataclass(frozen=True)
class Conv:
    cin: int
    cout: int
    stride: int = 1
    pool: str = ""  # "", "avg" (k3 s2 p1) or "max" (k2 s2)
    bias: bool = False


@dataclass(frozen=True)
class Dense:
    fin: int
    fout: int
    activation: bool = True


@dataclass
class Traffic:
    """Bytes per sample (activations) and per step (parameters), by block."""

    per_sample: dict[str, int] = field(default_factory=dict)
    per_step: dict[str, int] = field(default_factory=dict)

    def total(self, batch: int) -> int:
        return batch * sum(self.per_sample.values()) + sum(self.per_step.values())

    def block(self, name: str, batch: int) -> int:
        return batch * self.per_sample.get(name, 0) + self.per_step.get(name, 0)


def conv_sample_bytes(layer: Conv, width: int, itemsize: int, first: bool) -> int:
    """One convolution block's activation traffic per sample (``width``: its input's)."""
    x = layer.cin * width ** 3
    y = layer.cout * (width // layer.stride) ** 3
    pooled = y // 8 if layer.pool else y
    forward = x + y + (y + pooled if layer.pool else 0)
    backward = (pooled + y if layer.pool else 0)  # pool backward: read dP, write dY
    backward += pooled if layer.pool == "max" else y  # the activation's mask, read once
    backward += 0 if first else y + x  # data gradient: read dY, write dX
    backward += x + y  # weight gradient: read X and dY
    argmax = 2 * pooled if layer.pool == "max" else 0  # int8: written, read back
    return (forward + backward) * itemsize + argmax


def dense_sample_bytes(layer: Dense, itemsize: int) -> int:
    forward = layer.fin + layer.fout
    backward = (layer.fout if layer.activation else 0) + layer.fout + layer.fin
    backward += layer.fin + layer.fout  # weight gradient
    return (forward + backward) * itemsize


def parameter_bytes(count: int, itemsize: int, data_gradient: bool) -> int:
    """A layer's parameters in one step: forward (and data gradient) read them, the weight
    gradient writes them, SGD with momentum updates them."""
    uses = (2 if data_gradient else 1) * itemsize + itemsize  # reads, gradient write
    update = MASTER + itemsize + MASTER + MASTER + MASTER  # w, g, m read; w, m written
    copy = itemsize if itemsize < MASTER else 0  # the bf16 copy of the weights
    return count * (uses + update + copy)


def step_traffic(layers: list[Conv | Dense], width: int, itemsize: int,
                 outputs: int = 4) -> Traffic:
    """The compulsory traffic of a training step of ``layers`` at input ``width``."""
    traffic = Traffic()
    for index, layer in enumerate(layers):
        first = index == 0
        if isinstance(layer, Conv):
            name = f"conv{index + 1}"
            traffic.per_sample[name] = conv_sample_bytes(layer, width, itemsize, first)
            count = layer.cout * layer.cin * KERNEL + (layer.cout if layer.bias else 0)
            width = width // layer.stride // (2 if layer.pool else 1)
        else:
            name = f"fc{index + 1 - sum(isinstance(x, Conv) for x in layers)}"
            traffic.per_sample[name] = dense_sample_bytes(layer, itemsize)
            count = layer.fin * layer.fout + layer.fout
        traffic.per_step[name] = parameter_bytes(count, itemsize, not first)
    traffic.per_sample["loss"] = 3 * outputs * itemsize  # read pred, target; write grad
    return traffic


def cosmoflow_layers(width: int, channels: int = 4, outputs: int = 4) -> list[Conv | Dense]:
    """The paper network (models/cosmoflow.py): seven k3 convolutions without bias, 16,
    32, 64, 128, 256, 256, 256 filters, conv4 of stride 2, an average pool after conv1-5
    (conv6 from W = 256, conv7 from W = 512); fc 2048, 256, outputs."""
    filters = (16, 32, 64, 128, 256, 256, 256)
    layers: list[Conv | Dense] = []
    cin, side = channels, width
    for i, cout in enumerate(filters, start=1):
        stride = 2 if i == 4 else 1
        pooled = i <= 5 or (i == 6 and width >= 256) or (i == 7 and width >= 512)
        layers.append(Conv(cin, cout, stride, "avg" if pooled else ""))
        cin, side = cout, side // stride // (2 if pooled else 1)
    features = cin * side ** 3
    return [*layers, Dense(features, 2048), Dense(2048, 256), Dense(256, outputs, False)]


def mlperf_layers(width: int, channels: int = 4, outputs: int = 4) -> list[Conv | Dense]:
    """The MLPerf network (models/mlperf.py): five k3 convolutions with bias, 32 to 512
    filters, each followed by a k2 max pool; fc 128, 64, outputs."""
    layers: list[Conv | Dense] = []
    cin = channels
    for cout in (32, 64, 128, 256, 512):
        layers.append(Conv(cin, cout, 1, "max", bias=True))
        cin = cout
    features = cin * (width // 32) ** 3
    return [*layers, Dense(features, 128), Dense(128, 64), Dense(64, outputs, False)]


NETWORKS = {"cosmoflow": cosmoflow_layers, "mlperf": mlperf_layers}


def network_traffic(network: str, width: int, itemsize: int) -> Traffic:
    """The compulsory traffic of ``network`` ("cosmoflow" or "mlperf") at ``width``."""
    return step_traffic(NETWORKS[network](width), width, itemsize)
