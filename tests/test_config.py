"""Every config rule has a failing example: the message names the key and the fix, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cosmotrain.config import load_config, resolve_parallel, save_resolved
from cosmotrain.config.load import known_keys
from cosmotrain.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = [
    "model.name", "model.width", "model.dropout", "model.batchnorm", "data.path",
    "data.reader", "data.transform", "parallel.sample", "parallel.channel", "parallel.filter",
    "parallel.depth", "parallel.height", "parallel.width", "train.batch_size", "train.epochs",
    "train.max_steps", "train.seed", "optimizer.name", "optimizer.lr", "output.dir",
]


def test_schema_has_the_keys_scripts_rely_on() -> None:
    assert set(REQUIRED_KEYS) <= set(known_keys())


@pytest.mark.parametrize("name", ["quickstart", "cosmoflow-128", "cosmoflow-512-hybrid",
                                  "resnet3d", "tiny"])
def test_shipped_configs_are_valid(name: str) -> None:
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert resolve_parallel(cfg, 1 if name != "cosmoflow-512-hybrid" else 512).size >= 1


def test_set_overrides_are_parsed_to_the_key_type() -> None:
    cfg = load_config(None, ["train.batch_size=8", "optimizer.lr=1e-4", "model.batchnorm=yes",
                             "model.dropout=0.5", "train.max_steps=null", "parallel.sample=2",
                             "output.dir=runs/2024", "data.synthetic.samples=32"])
    assert cfg.train.batch_size == 8 and cfg.optimizer.lr == pytest.approx(1e-4)
    assert cfg.model.batchnorm is True and cfg.model.dropout == 0.5
    assert cfg.train.max_steps is None and cfg.parallel.sample == 2
    assert cfg.output.dir == "runs/2024" and cfg.data.synthetic.samples == 32


def test_set_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 4\n")
    assert load_config(path, ["train.batch_size=16"]).train.batch_size == 16


@pytest.mark.parametrize("overrides, key, fragment", [
    (["train.bach_size=3"], "train.bach_size", "did you mean 'train.batch_size'"),
    (["modle.name=tiny"], "modle", "did you mean 'model'"),
    (["train.lr=0.1"], "train.lr", "did you mean 'optimizer.lr'"),
    (["train.zzz=0.1"], "train.zzz", "valid keys here: train.batch_size"),
    (["train.epochs=two"], "train.epochs", "expected an integer"),
    (["train.epochs=1.5"], "train.epochs", "expected an integer"),
    (["optimizer.lr=fast"], "optimizer.lr", "expected a number"),
    (["model.batchnorm=maybe"], "model.batchnorm", "expected true or false"),
    (["train.batch_size=true"], "train.batch_size", "expected an integer"),
    (["model.name=vgg"], "model.name", "choose one of: cosmoflow"),
    (["model.dropout=1.0"], "model.dropout", "use a value < 1.0"),
    (["model.leaky_slope=2"], "model.leaky_slope", "use a value <= 1.0"),
    (["train.batch_size=0"], "train.batch_size", "use a value >= 1"),
    (["optimizer.lr=-1"], "optimizer.lr", "below the minimum"),
    (["parallel.sample=many"], "parallel.sample", "an integer or auto"),
    (["train.seed=null"], "train.seed", "expected an integer"),
    (["train.batch_size.x=1"], "train.batch_size", "expected an integer"),
    (["model=3"], "model", "expected a mapping"),
])
def test_bad_values_name_the_key(overrides: list[str], key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key
    assert f"'{key}'" in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("assignment", ["train.batch_size", "=3", ""])
def test_malformed_set_is_rejected(assignment: str) -> None:
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_config(None, [assignment])


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: [tiny\n")
    with pytest.raises(UserError, match="line"):
        load_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- model\n")
    with pytest.raises(UserError, match="top level must be a mapping"):
        load_config(listing)


@pytest.mark.parametrize("overrides, world, key, fragment", [
    (["parallel.sample=3"], 4, "parallel", "multiply to 3"),
    (["parallel.depth=2", "parallel.height=2", "parallel.sample=2"], 4, "parallel",
     "multiply to 8"),
    (["parallel.depth=4"], 6, "parallel.sample", "do not divide"),
    (["train.batch_size=6", "parallel.sample=4"], 4, "train.batch_size", "multiple of 4"),
    (["model.width=8", "parallel.depth=16"], 16, "parallel.depth", "smaller than the halo"),
])
def test_parallel_rules(overrides: list[str], world: int, key: str, fragment: str) -> None:
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        resolve_parallel(cfg, world)
    assert info.value.key == key and fragment in str(info.value)


def test_parallel_auto_takes_the_remaining_ranks() -> None:
    cfg = load_config(None, ["parallel.depth=2", "parallel.height=2", "train.batch_size=4"])
    layout = resolve_parallel(cfg, 8)
    assert (layout.sample, layout.spatial, layout.describe()) == (2, (2, 2, 1), "N2D2H2")


def test_resolved_config_is_saved_atomically(tmp_path: Path) -> None:
    cfg = load_config(None, ["train.batch_size=12"])
    path = save_resolved(cfg, tmp_path / "out")
    assert yaml.safe_load(path.read_text())["train"]["batch_size"] == 12
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]
    assert load_config(path).train.batch_size == 12
