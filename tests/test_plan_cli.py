"""``cosmotrain calibrate``, ``plan`` and ``parallel: auto`` end to end (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import REPO, mpiexec, subprocess_env

from cosmotrain.config import load_config
from cosmotrain.plan.machine import MachineModel

TINY = ["model.name=tiny", "model.width=16", "train.batch_size=4"]


def run(*args: str, ranks: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cosmotrain", *args]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    return subprocess.run(command, cwd=REPO, env={**subprocess_env(), **(env or {})},
                          capture_output=True, text=True, timeout=180)


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def machine_file(tmp_path_factory) -> Path:
    """A calibration of the tiny model on 2 ranks (layers, concurrency, links)."""
    path = tmp_path_factory.mktemp("machine") / "machine.json"
    done = run("calibrate", *sets(*TINY), "--out", str(path), "--repeats", "1", ranks=2)
    assert done.returncode == 0, done.stderr
    return path


def test_calibration_measures_layers_concurrency_and_links(machine_file: Path) -> None:
    machine = MachineModel.load(machine_file)
    assert set(machine.layers) == {1, 2}  # every level of ranks per node up to the job
    convs = [key for key in machine.layers[1] if key.startswith("Conv3d:")]
    assert convs and set(machine.layers[2]) == set(machine.layers[1])
    for curve in machine.layers[1].values():  # timed at >= 2 sizes, never negative
        assert len(curve.points) >= 2 and all(t >= 0 for _, t in curve.points)
    assert any(curve.points[-1][1] > 0 for key, curve in machine.layers[1].items()
               if key in convs)
    assert set(machine.concurrency) == {1, 2} and machine.concurrency[1] == 1.0
    assert machine.concurrency[2] > 0
    assert machine.flop_rate["Conv3d"] > 1e6
    assert set(machine.intra.collectives) == {"allreduce", "allgather", "reduce_scatter",
                                              "alltoall"}
    assert machine.intra.collectives["allreduce"][2].b > 0 and machine.intra.p2p.b > 0
    assert set(machine.intra.alone) == set(machine.intra.collectives)
    assert machine.element_time["optimizer"] > 0


def test_a_new_calibration_keeps_the_one_before(machine_file: Path, tmp_path: Path) -> None:
    from cosmotrain.study.calibrate import save_keeping_previous

    machine = MachineModel.load(machine_file)
    path = tmp_path / "machine.json"
    assert save_keeping_previous(machine, path) == (path, None)
    earlier = path.read_text()
    saved, previous = save_keeping_previous(replace(machine, name="later"), path, now=0.0)
    assert saved == path and MachineModel.load(path).name == "later"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(0))
    assert previous == tmp_path / f"machine.previous-{stamp}.json"
    assert previous.read_text() == earlier
    again = save_keeping_previous(machine, path, now=0.0)[1]
    assert again is not None and again.name.endswith("-2.json") and again != previous
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["machine.json", previous.name, again.name])  # no temporary file left


def test_a_calibration_that_cannot_keep_the_one_before_replaces_nothing(
        machine_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import shutil

    from cosmotrain.errors import WriteError
    from cosmotrain.study.calibrate import save_keeping_previous

    path = tmp_path / "machine.json"
    path.write_text(machine_file.read_text())

    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "copy2", full)
    machine = MachineModel.load(machine_file)
    with pytest.raises(WriteError, match="machine.previous-.*No space left on device"):
        save_keeping_previous(replace(machine, name="later"), path)
    assert path.read_text() == machine_file.read_text()


def test_plan_ranks_applies_and_auto_uses_it(machine_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "planned.yaml"
    done = run("plan", *sets(*TINY), "--ranks", "4", "--machine", str(machine_file),
               "--ranks-per-node", "4", "--json", "--apply", str(out))  # as mpiexec here
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout[:done.stdout.rindex("}") + 1])
    steps = [row["step_s"] for row in report["strategies"]]
    assert steps == sorted(steps) and len(steps) >= 5
    best = report["strategies"][0]
    applied = load_config(out)
    assert yaml.safe_load(out.read_text())["parallel"] == best["parallel"] | {
        "bn_statistics": "global", "bucket_mb": 25.0, "shard_optimizer": False}
    assert applied.model.name == "tiny"
    auto = run("train", *sets(*TINY, "parallel=auto", f"parallel.machine={machine_file}"),
               "--dry-run", ranks=4)
    assert auto.returncode == 0, auto.stderr
    assert f"parallel: auto chose {best['strategy']} for 4 rank(s)" in auto.stdout


def test_plan_errors_exit_2(tmp_path: Path) -> None:
    missing = run("plan", *sets(*TINY), "--ranks", "2", "--machine",
                  str(tmp_path / "none.json"))  # asked for by name: no estimate instead
    assert missing.returncode == 2
    assert f"machine file '{tmp_path / 'none.json'}': not found" in missing.stderr
    (tmp_path / "bad.json").write_text("{}")
    bad = run("plan", *sets(*TINY), "--ranks", "2", "--machine", str(tmp_path / "bad.json"))
    assert bad.returncode == 2
    assert f"machine file '{tmp_path / 'bad.json'}': unreadable" in bad.stderr
    none = run("plan", *sets(*TINY), "--ranks", "3", "--machine", "h100",
               "--memory-per-rank", "0.000001")
    assert none.returncode == 2 and "no strategy for 3 rank(s) fits" in none.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text("# my own config, with comments\nmodel: {name: tiny}\n")
    kept = run("plan", *sets(*TINY), "--ranks", "2", "--machine", "h100", "--apply", str(mine))
    assert kept.returncode == 2 and f"--apply '{mine}' already exists" in kept.stderr
    assert mine.read_text().startswith("# my own config")
    replaced = run("plan", *sets(*TINY), "--ranks", "2", "--machine", "h100", "--apply",
                   str(mine), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert yaml.safe_load(mine.read_text())["model"]["name"] == "tiny"
