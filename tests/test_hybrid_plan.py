"""Where spatial parallelism stops, and the layers' empty-batch behaviour (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.config.schema import ModelConfig
from cosmotrain.errors import ConfigError
from cosmotrain.layers.hybrid import MIN_BLOCK_PLANES, spatial_stop
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context


def names(model):
    return [layer.name for layer in model.items]


def test_no_spatial_split_means_all_data_parallel() -> None:
    model = build_model(ModelConfig(width=128), 0)
    assert spatial_stop(model, (1, 4, 128, 128, 128), (1, 1, 1)) == 0


def test_auto_stop_is_the_first_thin_layer() -> None:
    model = build_model(ModelConfig(width=128), 0)
    # 8-way: pool4's input 8/2 = 4 planes (kept), conv5's 4/2 = 2 (stop)
    assert model.items[spatial_stop(model, (1, 4, 128, 128, 128), (2, 2, 2))].name == "conv5"
    # 4-way along depth: conv4's input 16/4 = 4; act4 is element-wise; pool4's 8/4 = 2
    assert model.items[spatial_stop(model, (1, 4, 128, 128, 128), (4, 1, 1))].name == "pool4"
    assert MIN_BLOCK_PLANES == 4


def test_auto_stop_resnet_before_global_pool() -> None:
    model = build_model(ModelConfig(name="resnet3d", width=64, depth=10), 0)
    stop = model.items[spatial_stop(model, (1, 4, 64, 64, 64), (2, 1, 1))].name
    assert stop in names(model)
    assert names(model).index(stop) <= names(model).index("avgpool")


def test_named_stop_and_its_errors() -> None:
    model = build_model(ModelConfig(name="tiny", width=16), 0)
    shape = (2, 4, 16, 16, 16)
    assert spatial_stop(model, shape, (2, 1, 1), "pool2") == names(model).index("pool2")
    with pytest.raises(ConfigError, match="no top-level layer 'conv9'.*one of: conv1"):
        spatial_stop(model, shape, (2, 1, 1), "conv9")
    with pytest.raises(ConfigError, match="'flatten' before 'fc2' cannot run on spatial"):
        spatial_stop(model, shape, (2, 1, 1), "fc2")


@pytest.mark.parametrize("name", ["tiny", "cosmoflow", "resnet3d"])
def test_every_layer_accepts_an_empty_batch(name: str) -> None:
    """A rank holding no sample after the redistribution still runs the layers.

    (Batch norm on an empty block is covered by the MPI tests: on one process the
    global count would be zero.)"""
    cfg = ModelConfig(name=name, width=16, dropout=0.5, depth=10,
                      base_channels=4)
    model = build_model(cfg, 0)
    model.needs_input_grad = True
    x = np.zeros((0, 4, 16, 16, 16), np.float32)
    y = model.forward(x, Context())
    assert y.shape == (0, 4)
    dx = model.backward(np.zeros_like(y), Context())
    assert dx.shape == x.shape
    for key, param in model.named_parameters():
        assert param.grad is not None and not param.grad.any(), key
