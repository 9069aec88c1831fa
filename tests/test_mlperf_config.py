"""``configs/cosmoflow-mlperf.yaml``: the MLPerf HPC CosmoFlow reference's hyperparameters
(REFERENCE.md; mlcommons/hpc ``cosmoflow/configs/cosmo.yaml``), and a short run of it that
writes the MLPerf log with the reference's optimizer and schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO

from cosmotrain.config import load_config
from cosmotrain.config.schema import ModelConfig
from cosmotrain.models import build_model
from cosmotrain.nn.layers import Dropout, LeakyReLU

CONFIG = REPO / "configs" / "cosmoflow-mlperf.yaml"


def slopes_and_dropouts(cfg: ModelConfig) -> tuple[set[float], set[float], int]:
    model = build_model(cfg, 0)
    layers = [layer for _, layer in model.named_layers()]
    params = sum(p.data.size for _, p in model.named_parameters())
    return ({layer.slope for layer in layers if isinstance(layer, LeakyReLU)},
            {layer.p for layer in layers if isinstance(layer, Dropout)}, params)


def test_the_config_holds_the_references_hyperparameters() -> None:
    cfg = load_config(CONFIG)
    assert (cfg.model.name, cfg.model.width, cfg.model.dropout) == ("cosmoflow-mlperf", 128, 0.5)
    assert slopes_and_dropouts(cfg.model) == ({0.3}, {0.5}, 8_907_556)
    assert (cfg.optimizer.name, cfg.optimizer.momentum) == ("sgd", 0.9)
    assert cfg.optimizer.lr == pytest.approx(0.001 * cfg.train.batch_size / 64)
    schedule = cfg.optimizer.schedule
    assert (schedule.name, schedule.warmup_epochs, schedule.warmup_start_lr) == ("step", 4, 0.001)
    assert (schedule.decay_epochs, schedule.decay_factors) == ("32,64", "0.25,0.125")
    assert (cfg.train.epochs, cfg.train.validate_every, cfg.train.target_mae) == (128, 1, 0.124)
    assert (cfg.data.transform, cfg.data.shuffle, cfg.output.mlperf_log) == \
        ("log1p", "local", True)


def test_the_mlperf_models_own_slope_is_the_references() -> None:
    """No slope given: the reference's 0.3 (Keras's LeakyReLU default), whatever config
    the model name is set in; the paper network keeps its 0.01."""
    assert slopes_and_dropouts(ModelConfig(name="cosmoflow-mlperf", width=32))[0] == {0.3}
    assert slopes_and_dropouts(ModelConfig(name="cosmoflow", width=16))[0] == {0.01}


def test_the_config_trains_and_writes_the_mlperf_log(cli, tmp_path: Path) -> None:
    pytest.importorskip("mlperf_logging")
    out = tmp_path / "run"
    sets = ["model.width=32", "data.source=synthetic", "data.synthetic.samples=9",
            "train.batch_size=4", "optimizer.lr=0.0000625", "train.max_steps=2",
            f"output.dir={out}"]  # 0.001 x 4 / 64: the linear rule at batch 4
    code, _, err = cli("train", "-c", str(CONFIG), *(a for s in sets for a in ("--set", s)))
    assert code == 0, err
    log = [json.loads(line.split(":::MLLOG", 1)[1])
           for line in (out / "mlperf.log").read_text().splitlines() if ":::MLLOG" in line]
    found = {entry["key"]: entry["value"] for entry in log}
    assert found["opt_name"] == "sgd" and found["dropout"] == 0.5
    assert found["opt_base_learning_rate"] == pytest.approx(0.0000625)
    assert found["opt_learning_rate_warmup_epochs"] == 4
    assert found["opt_learning_rate_decay_boundary_epochs"] == [32, 64]
    assert found["opt_learning_rate_decay_factor"] == [0.25, 0.125]
    assert log[-1]["key"] == "run_stop"
