"""The serial networks (``cosmoflow``, ``mlperf``, ``resnet3d``, ``tiny``), built from
``nn`` layers, and the registry that builds one from the ``model`` config section."""

from __future__ import annotations

from cosmotrain.config.schema import ModelConfig
from cosmotrain.errors import ConfigError
from cosmotrain.models.cosmoflow import build_cosmoflow, cosmoflow_init
from cosmotrain.models.mlperf import build_mlperf, mlperf_init
from cosmotrain.models.resnet3d import build_resnet3d, resnet3d_init
from cosmotrain.models.tiny import build_tiny, tiny_init
from cosmotrain.nn.containers import Sequential
from cosmotrain.nn.init import initialize

DEFAULT_SLOPES = {"cosmoflow": 0.01, "cosmoflow-mlperf": 0.3, "tiny": 0.01}
MIN_WIDTH = {"cosmoflow": 8, "cosmoflow-mlperf": 32, "resnet3d": 8, "tiny": 8}


def build_model(cfg: ModelConfig, seed: int) -> Sequential:
    """The network named by ``cfg.name``, its parameters initialised from ``seed``."""
    if cfg.width < MIN_WIDTH[cfg.name]:
        raise ConfigError("model.width", f"{cfg.width} is too small for {cfg.name}",
                          f"use at least {MIN_WIDTH[cfg.name]}")
    slope = cfg.leaky_slope if cfg.leaky_slope is not None else DEFAULT_SLOPES.get(cfg.name)
    common = dict(width=cfg.width, channels=cfg.channels, outputs=cfg.outputs)
    if cfg.name == "cosmoflow":
        model = build_cosmoflow(**common, dropout=cfg.dropout, batchnorm=cfg.batchnorm,
                                slope=slope)
        rules = cosmoflow_init
    elif cfg.name == "cosmoflow-mlperf":
        model = build_mlperf(**common, dropout=cfg.dropout, batchnorm=cfg.batchnorm,
                             slope=slope)
        rules = mlperf_init
    elif cfg.name == "resnet3d":
        model = build_resnet3d(**common, depth=cfg.depth, block=cfg.block,
                               base=cfg.base_channels, batchnorm=cfg.batchnorm)
        rules = resnet3d_init
    else:
        model = build_tiny(**common, dropout=cfg.dropout, batchnorm=cfg.batchnorm, slope=slope)
        rules = tiny_init
    initialize(model, seed, rules)
    return model

