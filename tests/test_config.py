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


@pytest.mark.parametrize("name", ["quickstart", "cosmoflow-128", "cosmoflow-mlperf",
                                  "cosmoflow-512-hybrid", "resnet3d", "tiny"])
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


@pytest.mark.parametrize("assignment", [
    "optimizer.lr=nan", "optimizer.lr=inf", "optimizer.lr=.inf", "optimizer.lr=-.inf",
    "optimizer.eps=NaN", "model.dropout=nan", "train.target_mae=inf",
    "parallel.bucket_mb=1e999", "optimizer.schedule.warmup_epochs=nan",
    "data.synthetic.val_fraction=nan", "model.leaky_slope=nan",
])
def test_non_finite_floats_are_rejected(assignment: str) -> None:
    key = assignment.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config(None, [assignment])
    assert info.value.key == key and "is not a finite number" in str(info.value)


def test_every_float_key_rejects_nan_and_inf(tmp_path: Path) -> None:
    """No float key of the schema lets nan or inf through, from --set or from YAML."""
    import dataclasses
    import typing

    from cosmotrain.config.schema import Config

    def float_keys(cls: type, prefix: str = "") -> list[str]:
        found = []
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                found += float_keys(hint, f"{prefix}{f.name}.")
            elif float in (hint, *typing.get_args(hint)):
                found.append(f"{prefix}{f.name}")
        return found

    keys = float_keys(Config)
    assert "optimizer.lr" in keys and len(keys) >= 10
    for key in keys:
        for text in ("nan", "-inf"):
            with pytest.raises(ConfigError, match="not a finite number"):
                load_config(None, [f"{key}={text}"])
        tree: dict = {}
        *sections, leaf = key.split(".")
        node = tree
        for part in sections:
            node = node.setdefault(part, {})
        node[leaf] = float("nan")
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(tree))  # written as .nan
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert info.value.key == key


def test_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  name: tiny  # r\u00e9sum\u00e9\n".encode("latin-1"))
    with pytest.raises(UserError) as info:
        load_config(path)
    message = str(info.value)
    assert f"config file '{path}'" in message and "not UTF-8" in message
    assert "line 2" in message and "UTF-8 encoding" in message and "\n" not in message
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfmodel:\n  name: tiny\n")  # UTF-8 with a byte-order mark
    assert load_config(bom).model.name == "tiny"


@pytest.mark.parametrize("text, key, lines", [
    ("train:\n  batch_size: 4\n  epochs: 2\n  batch_size: 8\n", "train.batch_size", (2, 4)),
    ("model:\n  name: tiny\ntrain:\n  epochs: 1\nmodel:\n  width: 8\n", "model", (1, 5)),
    ("parallel:\n  layers:\n    conv1: {algorithm: y, algorithm: x}\n",
     "parallel.layers.conv1.algorithm", (3, 3)),
])
def test_duplicate_yaml_keys_are_rejected(tmp_path: Path, text: str, key: str,
                                          lines: tuple[int, int]) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert f"lines {lines[0]} and {lines[1]}" in str(info.value)
    assert f"'{path}'" in str(info.value) and "keep one" in str(info.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    from cosmotrain.config.load import read_yaml

    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {lr: 0.1, eps: 1.0e-6}\noptimizer:\n  <<: *b\n  lr: 0.01\n")
    assert read_yaml(path)["optimizer"] == {"lr": 0.01, "eps": 1e-6}
