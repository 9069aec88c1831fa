"""The serial reference of the distributed-convolution tests (shared by two test files)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cosmotrain.layers.conv import SpatialConv3d, spatial_conv
from cosmotrain.nn.layers import Conv3d
from cosmotrain.nn.module import Context


def serial_conv_run(make_conv: Callable[[], Conv3d], cin: int, spatial: tuple[int, ...],
                    seed: int) -> tuple[Conv3d, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(layer, x, y, dy, dx)``: a float64 serial conv with random weights, run both ways."""
    serial = make_conv()
    rng = np.random.default_rng(seed)
    for param in serial.params.values():
        param.data = rng.normal(size=param.shape)
    x = rng.normal(size=(2, cin) + tuple(spatial))
    y = serial.forward(x, Context())
    dy = rng.normal(size=y.shape)
    return serial, x, y, dy, serial.backward(dy, Context())


def spatial_twin(serial: Conv3d, make_conv: Callable[[], Conv3d], grid) -> SpatialConv3d:
    """A fresh distributed conv holding copies of ``serial``'s weights."""
    layer = spatial_conv(make_conv(), grid)
    for key, param in layer.params.items():
        param.data = serial.params[key].data.copy()
    return layer
