"""Constructors that give layers their parameters (zeros until :func:`initialize`)."""

from __future__ import annotations

import numpy as np

from cosmotrain.kernels.geometry import normalize_padding, normalize_triple
from cosmotrain.nn.layers import BatchNorm3d, Conv3d, Linear
from cosmotrain.nn.module import Parameter


def _zeros(*shape: int) -> Parameter:
    return Parameter(np.zeros(shape, dtype=np.float32))


def conv(name: str, cin: int, cout: int, kernel: int = 3, stride: int = 1,
         padding: int = 1, bias: bool = False) -> Conv3d:
    k = normalize_triple(kernel, "kernel")
    params = {"weight": _zeros(cout, cin, *k)}
    if bias:
        params["bias"] = _zeros(cout)
    return Conv3d(name=name, params=params, in_channels=cin, out_channels=cout, kernel=k,
                  stride=normalize_triple(stride, "stride"), padding=normalize_padding(padding),
                  bias=bias)


def batchnorm(name: str, channels: int) -> BatchNorm3d:
    params = {"weight": Parameter(np.ones(channels, dtype=np.float32)),
              "bias": _zeros(channels)}
    buffers = {"running_mean": np.zeros(channels, dtype=np.float32),
               "running_var": np.ones(channels, dtype=np.float32),
               "num_batches_tracked": np.int64(0)}
    return BatchNorm3d(name=name, params=params, buffers=buffers, channels=channels)


def linear(name: str, fin: int, fout: int, bias: bool = True) -> Linear:
    params = {"weight": _zeros(fout, fin)}
    if bias:
        params["bias"] = _zeros(fout)
    return Linear(name=name, params=params, in_features=fin, out_features=fout)
