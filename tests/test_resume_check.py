"""Resume compatibility: which config changes a resumed run may make."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from cosmotrain.config.load import config_to_dict, dump_yaml, known_keys, load_config
from cosmotrain.errors import UserError
from cosmotrain.train.checkpoints import resume_check
from cosmotrain.train.checkpoints.resume_check import (ALLOW, MISSING, REFUSE, RULES, UNKNOWN,
                                                        Change, compare_for_resume, rule_for, show)

CKPT = "runs/x/checkpoints/ckpt_step0000040.h5"


def config(*overrides: str) -> dict[str, Any]:
    """A resolved config as the trainer has it (``config_to_dict``)."""
    return config_to_dict(load_config(None, list(overrides)))


def saved(*overrides: str) -> dict[str, Any]:
    """A resolved config as a checkpoint stores it: YAML text, loaded back."""
    return yaml.safe_load(dump_yaml(load_config(None, list(overrides))))


def changed_keys(changes: list[Change]) -> list[str]:
    return [c.key for c in changes]


def test_every_schema_key_is_classified_explicitly() -> None:
    """Adding a config key without deciding whether a resume may change it fails here."""
    keys = known_keys()
    missing = [key for key in keys if rule_for(key) is UNKNOWN]
    assert not missing, f"classify these keys in resume_check.RULES: {missing}"
    assert all(key in RULES for key in keys)
    stale = [key for key in RULES if key not in keys]
    assert not stale, f"RULES names keys the schema no longer has: {stale}"
    assert {rule.action for rule in RULES.values()} == {ALLOW, REFUSE}


def test_an_unchanged_config_resumes() -> None:
    diff = compare_for_resume(saved("model.name=tiny", "model.width=16"),
                              config("model.name=tiny", "model.width=16"))
    assert diff.ok and not diff.refused and not diff.allowed
    assert diff.allowed_lines() == []
    diff.raise_if_refused(CKPT)


def test_the_refusal_names_every_changed_key_in_one_line() -> None:
    diff = compare_for_resume(saved("model.width=64", "model.batchnorm=true"),
                              config("model.width=32", "model.batchnorm=false"))
    assert not diff.ok
    assert diff.refused == [Change("model.width", 64, 32),
                            Change("model.batchnorm", True, False)]
    assert diff.refusal_message(CKPT) == (
        f"cannot resume from '{CKPT}': the config differs in model.width (64 -> 32), "
        f"model.batchnorm (true -> false); resume with the checkpoint's settings (its config "
        f"is stored in the checkpoint and in output.dir/config.yaml) or start a new run in "
        f"another output.dir")
    with pytest.raises(UserError) as err:
        diff.raise_if_refused(CKPT)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("old, new", [
    (["model.name=tiny"], ["model.name=cosmoflow"]),
    (["model.dropout=0.0"], ["model.dropout=0.5"]),
    (["model.channels=4"], ["model.channels=2"]),
    (["data.source=files", "data.path=/data/a"], ["data.source=files", "data.path=/data/b"]),
    (["data.source=synthetic"], ["data.source=files", "data.path=/data/a"]),
    (["data.source=synthetic", "data.synthetic.samples=64"],
     ["data.source=synthetic", "data.synthetic.samples=32"]),
    (["data.transform=log1p"], ["data.transform=mean"]),
    (["data.shuffle=global"], ["data.shuffle=local"]),
    (["data.drop_last=false"], ["data.drop_last=true"]),
    (["train.batch_size=8"], ["train.batch_size=4"]),
    (["train.seed=0"], ["train.seed=1"]),
    (["optimizer.name=adam"], ["optimizer.name=sgd"]),
    (["optimizer.name=sgd", "optimizer.momentum=0.9"],
     ["optimizer.name=sgd", "optimizer.momentum=0.5"]),
    (["optimizer.weight_decay=0"], ["optimizer.weight_decay=0.0001"]),
    (["optimizer.beta2=0.999"], ["optimizer.beta2=0.99"]),
    (["model.batchnorm=true", "parallel.bn_statistics=global"],
     ["model.batchnorm=true", "parallel.bn_statistics=local"]),
])
def test_changes_of_the_trajectory_are_refused(old: list[str], new: list[str]) -> None:
    diff = compare_for_resume(saved(*old), config(*new))
    assert not diff.ok, diff
    assert "cannot resume from" in diff.refusal_message(CKPT)


def test_layout_length_schedule_cadence_io_and_device_may_change() -> None:
    before = ["parallel.depth=1", "train.epochs=2", "train.max_steps=10", "optimizer.lr=0.001",
              "optimizer.schedule.name=constant", "optimizer.schedule.warmup_epochs=0",
              "train.log_every=1", "train.checkpoint_every_steps=5", "train.keep_checkpoints=3",
              "data.reader=preload", "data.stage_dir=/tmp/a", "data.prefetch=true",
              "device.backend=cpu", "output.dir=runs/old", "parallel.sample=auto"]
    after = ["parallel.depth=2", "train.epochs=8", "train.max_steps=null", "optimizer.lr=0.002",
             "optimizer.schedule.name=cosine", "optimizer.schedule.warmup_epochs=1.5",
             "train.log_every=10", "train.checkpoint_every_steps=null",
             "train.keep_checkpoints=5", "data.reader=direct", "data.stage_dir=null",
             "data.prefetch=false", "device.backend=auto", "output.dir=runs/new",
             "parallel.sample=2"]
    diff = compare_for_resume(saved(*before), config(*after))
    assert diff.ok, diff.refusal_message(CKPT)
    assert len(diff.allowed) == len(after)
    lines = diff.allowed_lines()
    assert "resume: parallel.depth 1 -> 2" in lines
    assert "resume: train.max_steps 10 -> null" in lines
    assert "resume: optimizer.lr 0.001 -> 0.002" in lines
    assert "resume: optimizer.schedule.warmup_epochs 0 -> 1.5" in lines
    assert "resume: parallel.sample auto -> 2" in lines
    assert "resume: data.prefetch true -> false" in lines


def test_keys_a_config_does_not_use_may_change() -> None:
    diff = compare_for_resume(
        saved("optimizer.name=adam", "optimizer.momentum=0.9", "model.name=tiny",
              "model.depth=18", "data.source=synthetic", "data.path=/old"),
        config("optimizer.name=adam", "optimizer.momentum=0.5", "model.name=tiny",
               "model.depth=50", "data.source=synthetic", "data.path=/new"))
    assert diff.ok
    assert diff.allowed_lines() == [
        "resume: model.depth 18 -> 50 (unused: only resnet3d uses it)",
        "resume: data.path /old -> /new (unused: data.source is synthetic)",
        "resume: optimizer.momentum 0.9 -> 0.5 (unused: optimizer.name is adam)"]
    # ... but not when either side uses it
    diff = compare_for_resume(saved("model.name=resnet3d", "model.depth=18"),
                              config("model.name=tiny", "model.depth=50"))
    assert changed_keys(diff.refused) == ["model.name", "model.depth"]
    diff = compare_for_resume(saved("model.batchnorm=false", "parallel.bn_statistics=global"),
                              config("model.batchnorm=false", "parallel.bn_statistics=local"))
    assert diff.ok and changed_keys(diff.allowed) == ["parallel.bn_statistics"]


def test_values_are_compared_as_config_values() -> None:
    diff = compare_for_resume(saved("data.source=files", "data.path=runs/data/",
                                    "optimizer.schedule.warmup_epochs=2"),
                              config("data.source=files", "data.path=./runs/data",
                                     "optimizer.schedule.warmup_epochs=2.0"))
    assert diff.ok and not diff.allowed


def test_bools_are_not_numbers_and_numbers_compare_by_value() -> None:
    assert resume_check.same_value("train.epochs", 4, 4.0)
    assert not resume_check.same_value("model.batchnorm", True, 1)
    assert not resume_check.same_value("model.batchnorm", 0, False)
    assert resume_check.same_value("model.batchnorm", True, True)


def test_a_key_an_older_checkpoint_lacks_is_taken_at_its_default() -> None:
    old = saved()
    del old["device"]  # written before the device section existed
    del old["model"]["leaky_slope"]
    assert compare_for_resume(old, config()).ok and not compare_for_resume(old, config()).allowed
    diff = compare_for_resume(old, config("model.leaky_slope=0.2"))
    assert diff.refused == [Change("model.leaky_slope", None, 0.2)]


def test_a_key_the_schema_no_longer_has_is_refused() -> None:
    old = saved()
    old["model"]["groups"] = 2
    diff = compare_for_resume(old, config())
    assert diff.refused == [Change("model.groups", 2, MISSING)]
    assert "model.groups (2 -> unset)" in diff.refusal_message(CKPT)


def test_per_layer_parallel_overrides_are_layout() -> None:
    diff = compare_for_resume(saved(), config("parallel.layers.conv1.algorithm=y"))
    assert diff.ok
    assert diff.allowed_lines() == ["resume: parallel.layers.conv1.algorithm unset -> y",
                                    "resume: parallel.layers.conv1.channel unset -> null"]
    assert compare_for_resume(config("parallel.layers.conv1.algorithm=y"), config()).ok


def test_layout_changes_that_do_change_the_trajectory_are_noted() -> None:
    diff = compare_for_resume(saved("data.shuffle=local", "parallel.sample=2"),
                              config("data.shuffle=local", "parallel.sample=4"))
    assert diff.ok and len(diff.caveats) == 1
    assert diff.allowed_lines()[-1].startswith("resume: note: data.shuffle is local")
    diff = compare_for_resume(saved("data.shuffle=local"), config("data.shuffle=local"))
    assert not diff.caveats


def test_many_refusals_stay_one_line() -> None:
    old, new = saved(), config()
    for key in ("width", "channels", "outputs", "dropout"):
        new["model"][key] = old["model"][key] + 1
    new["train"]["seed"] = 9
    new["train"]["batch_size"] = 9
    new["optimizer"]["name"] = "sgd"
    new["optimizer"]["weight_decay"] = 0.5
    new["optimizer"]["beta1"] = 0.5
    diff = compare_for_resume(old, new)
    assert len(diff.refused) == 9
    message = diff.refusal_message(CKPT)
    assert "\n" not in message and message.count(" -> ") == 8 and "and 1 more" in message


def test_inputs_are_not_modified() -> None:
    old, new = saved("model.width=64"), config("model.width=32")
    del old["device"]
    before = copy.deepcopy((old, new))
    compare_for_resume(old, new)
    assert (old, new) == before


@pytest.mark.parametrize("value, text", [
    (None, "null"), (True, "true"), (False, "false"), (64, "64"), (0.001, "0.001"),
    (1e-8, "1e-08"), (0.1 + 0.2, "0.30000000000000004"), ("log1p", "log1p"), ("", "''"),
    ({"a": 1, "b": None}, "{a: 1, b: null}"), (MISSING, "unset"), ("x" * 50, "x" * 37 + "..."),
])
def test_values_are_shown_compactly(value: Any, text: str) -> None:
    assert show(value) == text


def test_rule_lookup() -> None:
    assert rule_for("parallel.layers.conv3.channel") is RULES["parallel.layers"]
    assert rule_for("model.width").action == REFUSE
    assert rule_for("nonsense.key") is UNKNOWN and UNKNOWN.action == REFUSE
    assert resume_check.rule_for("output.dir").action == ALLOW
