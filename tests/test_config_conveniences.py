"""Config conveniences: YAML lists for the step schedule's keys, ``${VAR}`` in path keys
(expanded from the environment the command line hands down; a library call expands
nothing), each misuse a one-line ConfigError naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cosmotrain.config import load_config
from cosmotrain.config.expand import PATH_KEYS
from cosmotrain.errors import ConfigError
from cosmotrain.train.checkpoints.resume_check import PATH_KEYS as COMPARED_AS_PATHS
from cosmotrain.engine.schedule import build_schedule

S = "optimizer.schedule"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_lists_and_text_give_the_same_schedule(tmp_path: Path) -> None:
    listed = load_config(write(tmp_path, "optimizer:\n  schedule:\n    name: step\n"
                                         "    decay_epochs: [32, 64]\n"
                                         "    decay_factors: [0.25, 0.125]\n"))
    text = load_config(None, [f"{S}.name=step", f"{S}.decay_epochs=32,64",
                              f"{S}.decay_factors=0.25,0.125"])
    assert listed.optimizer.schedule.decay_epochs == "32,64"   # one stored form
    assert listed.optimizer.schedule == text.optimizer.schedule
    schedule = build_schedule(listed)
    assert schedule.decay_epochs == (32.0, 64.0) and schedule.decay_factors == (0.25, 0.125)


def test_a_list_can_be_set_on_the_command_line() -> None:
    cfg = load_config(None, [f"{S}.name=step", f"{S}.decay_epochs=[3, 7]",
                             f"{S}.decay_factors=[0.1, 0.01]"])
    assert build_schedule(cfg).decay_epochs == (3.0, 7.0)


@pytest.mark.parametrize("value", ["[32, fast]", "[[32], 64]", "[true]"])
def test_a_list_of_non_numbers_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{S}.decay_epochs': expected a list of numbers"):
        load_config(None, [f"{S}.decay_epochs={value}"])


def test_lists_only_where_declared() -> None:
    with pytest.raises(ConfigError, match="'output.dir': expected a string"):
        load_config(None, ["output.dir=[a, b]"])


def test_vars_expand_in_every_path_key(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  path: ${DATA}/cosmo\n  stage_dir: ${TMP}/stage\n"
                           "  cache_dir: ${HOME_}/c\noutput:\n  dir: ${SCRATCH}/runs/${RUN}\n")
    env = {"DATA": "/d", "TMP": "/t", "HOME_": "/h", "SCRATCH": "/s", "RUN": "a"}
    cfg = load_config(path, env=env)
    assert (cfg.data.path, cfg.data.stage_dir, cfg.data.cache_dir, cfg.output.dir) == \
        ("/d/cosmo", "/t/stage", "/h/c", "/s/runs/a")
    assert PATH_KEYS == COMPARED_AS_PATHS == {"data.path", "data.stage_dir", "data.cache_dir",
                                              "output.dir"}


def test_set_overrides_expand_too_and_dollars_escape() -> None:
    cfg = load_config(None, ["output.dir=${SCRATCH}/a$$b/$c/${RUN}x"],
                      env={"SCRATCH": "/s", "RUN": "7"})
    assert cfg.output.dir == "/s/a$b/$c/7x"  # $$ is one $, a bare $ stays
    cfg = load_config(None, ["output.dir=$${SCRATCH}"], env={"SCRATCH": "/s"})
    assert cfg.output.dir == "${SCRATCH}"


def test_only_path_keys_expand() -> None:
    cfg = load_config(None, ["parallel.machine=${NOT_A_PATH_KEY}"], env={})
    assert cfg.parallel.machine == "${NOT_A_PATH_KEY}"


def test_an_unset_variable_names_the_key_and_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, "output:\n  dir: ${SCRATCH}/runs\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert message.startswith("config key 'output.dir': ")
    assert "${SCRATCH}" in message and "not set" in message and "export SCRATCH=" in message


@pytest.mark.parametrize("text", ["${}", "${1X}", "${A-B}", "${OPEN"])
def test_a_malformed_variable_is_an_error(text: str) -> None:
    with pytest.raises(ConfigError, match="'data.path': .* malformed variable"):
        load_config(None, [f"data.path={text}"], env={"OPEN": "x"})


def test_a_library_call_expands_nothing(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "output:\n  dir: ${SCRATCH}/runs\n"))
    assert cfg.output.dir == "${SCRATCH}/runs"


def test_the_command_line_expands_from_the_environment(cli, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "output:\n  dir: ${COSMO_TEST_SCRATCH}/runs\n"
                           "optimizer:\n  schedule:\n    name: step\n"
                           "    decay_epochs: [2, 4]\n    decay_factors: [0.5, 0.25]\n")
    monkeypatch.delenv("COSMO_TEST_SCRATCH", raising=False)
    code, _, err = cli("config", "-c", str(path))
    assert code == 2 and "'output.dir'" in err and "${COSMO_TEST_SCRATCH}" in err
    monkeypatch.setenv("COSMO_TEST_SCRATCH", "/scratch/me")
    code, out, err = cli("config", "-c", str(path))
    assert code == 0, err
    body = yaml.safe_load(out)
    assert body["output"]["dir"] == "/scratch/me/runs"
    assert body["optimizer"]["schedule"]["decay_epochs"] == "2,4"
