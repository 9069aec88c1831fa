"""``plan`` and ``parallel: auto`` on a machine never calibrated, the plan's nodes x ranks
per node, and ``train --dry-run``'s memory check (issue 19), in-process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cosmotrain.config import load_config, resolve_parallel
from cosmotrain.plan.estimate import Probe, estimated_machine, thread_concurrency
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.memory import rank_memory, workload_memory
from cosmotrain.plan.planner import node_layout
from cosmotrain.train.auto_layout import load_machine
from cosmotrain.plan.workload import build_workload
from cosmotrain.study.estimate import estimate_path
from cosmotrain.train import dry_run

TINY = ["--set", "model.name=tiny", "--set", "model.width=16", "--set", "train.batch_size=4"]
CALIBRATED = "docs/perf/dev-2core.json"  # a real calibration: plan tests without a probe
HYBRID_512 = "configs/cosmoflow-512-hybrid.yaml"


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory with no machine file; the first test to plan probes once into it."""
    return tmp_path_factory.mktemp("fresh-machine")


@pytest.fixture
def uncalibrated(fresh_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$COSMOTRAIN_MACHINE`` names a file that does not exist (never calibrated)."""
    machine = fresh_home / "machine.json"
    monkeypatch.setenv("COSMOTRAIN_MACHINE", str(machine))
    return machine


def test_plan_without_a_machine_file_uses_a_quick_estimate_and_says_so(
        cli, uncalibrated: Path) -> None:
    code, out, err = cli("plan", *TINY, "--ranks", "2")
    assert code == 0, err
    assert "machine model: estimate of " in out
    assert "not a calibration; run `cosmotrain calibrate` for a measured one" in out
    assert "1 node x 2 ranks per node" in out
    cache = estimate_path(uncalibrated)
    assert not uncalibrated.exists() and cache.is_file()  # never posing as a calibration
    estimate = MachineModel.load(cache)
    assert estimate.source == "estimate" and estimate.flop_rate["Conv3d"] > 1e6
    assert estimate.element_time["LeakyReLU"] > 0 and estimate.concurrency[1] == 1.0
    assert estimate.memory_per_node_gib > 0
    code, out, err = cli("plan", *TINY, "--ranks", "2")  # the second time: no probe
    assert code == 0 and f"cached in {cache}" in out and "measuring" not in err


def test_parallel_auto_without_a_machine_file_uses_the_estimate(
        cli, uncalibrated: Path) -> None:
    code, out, err = cli("train", "-c", "configs/tiny.yaml", "--set", "parallel=auto",
                         "--dry-run")
    assert code == 0, err
    assert "parallel: auto chose N1 for 1 rank(s) (1 node x 1 rank per node; predicted" in out
    assert "machine model: estimate of " in out and "run `cosmotrain calibrate`" in out
    assert not uncalibrated.exists() and estimate_path(uncalibrated).is_file()


def test_the_estimate_is_found_under_xdg_cache_home(
        cli, uncalibrated: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli("plan", *TINY, "--ranks", "1")  # make sure the module's estimate exists
    monkeypatch.delenv("COSMOTRAIN_MACHINE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = tmp_path / "cosmotrain" / "machine.estimate.json"
    cached.parent.mkdir()
    shutil.copy(estimate_path(uncalibrated), cached)
    code, out, err = cli("plan", *TINY, "--ranks", "1", "--json")
    assert code == 0, err
    assert f"cached in {cached}" in err  # --json: the provenance line goes to stderr
    assert json.loads(out)["machine_source"] == "estimate"


def test_plan_prints_nodes_and_ranks_per_node(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def layout(*extra: str) -> dict:
        code, out, err = cli("plan", *TINY, "--ranks", "4", "--machine", CALIBRATED,
                             "--json", *extra)
        assert code == 0, err
        assert f"machine model: vm, calibrated by `cosmotrain calibrate` ({CALIBRATED})" in err
        return json.loads(out)

    mine = layout()  # no Slurm: what mpiexec -n 4 does here, not one rank per core
    assert (mine["nodes"], mine["ranks_per_node"]) == (1, 4)
    assert "all ranks on this node" in mine["ranks_per_node_from"]
    given = layout("--ranks-per-node", "2")
    assert (given["nodes"], given["ranks_per_node"]) == (2, 2)
    code, out, _ = cli("plan", *TINY, "--ranks", "4", "--machine", CALIBRATED)
    assert code == 0 and "on 4 rank(s) = 1 node x 4 ranks per node" in " ".join(out.split())
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x2)")
    slurm = layout()
    assert (slurm["nodes"], slurm["ranks_per_node"]) == (2, 2)
    assert "Slurm" in slurm["ranks_per_node_from"]


def test_node_layout_rules() -> None:
    cpu = MachineModel("cpu", cores_per_node=2)
    assert node_layout(4, machine=cpu).describe() == "1 node x 4 ranks per node"
    assert node_layout(4, 2, machine=cpu).describe() == "2 nodes x 2 ranks per node"
    assert node_layout(2, 8).per_node == 2
    assert node_layout(6, allocation=4).nodes == 2
    h100 = load_machine("h100")  # one rank per GPU, 4 GPUs per node, whatever Slurm says
    assert node_layout(8, allocation=8, machine=h100).describe() == "2 nodes x 4 ranks per node"


def test_estimated_machine_from_a_probe() -> None:
    probe = Probe("Test CPU", 4, 16.0, conv_flop_rate=4e10, linear_flop_rate=5e10,
                  element_time={"copy": 4e-10, "LeakyReLU": 8e-10, "Pool3d": 2e-9,
                                "optimizer": 2e-9, "input": 5e-10}, thread_speedup=2.0)
    machine = estimated_machine(probe)
    assert machine.source == "estimate" and machine.name == "estimate of Test CPU x 4 cores"
    assert machine.flop_rate == {"Conv3d": 4e10, "Linear": 5e10}
    assert machine.concurrency == pytest.approx({1: 1.0, 2: 2 ** 0.5, 4: 2.0})
    assert machine.element_time["Dropout"] == 8e-10  # like an activation
    assert machine.intra.p2p.b == pytest.approx(3 * 1e-10)  # 3 copies of each byte
    assert machine.intra.collectives["allreduce"][4].a > machine.intra.collectives[
        "allreduce"][2].a
    assert "run `cosmotrain calibrate`" in machine.describe()
    again = MachineModel.from_json(json.loads(json.dumps(machine.to_json())))
    assert again.source == "estimate" and again.concurrency == machine.concurrency
    assert thread_concurrency(1, 1.0) == {1: 1.0}
    assert thread_concurrency(2, 0.5) == {1: 1.0, 2: 1.0}  # threads that slow: no gain


def test_machine_source_defaults_to_calibrated_and_presets_say_so() -> None:
    data = MachineModel("old", 2).to_json()
    del data["source"]  # a file written before the field existed
    assert MachineModel.from_json(data).source == "calibrated"
    assert load_machine("a100").describe().startswith("preset a100 (public specifications")


def test_rank_memory_parts_add_up() -> None:
    cfg = load_config("configs/tiny.yaml", ["parallel.depth=2"])
    work = build_workload(cfg, resolve_parallel(cfg, 2))
    need = rank_memory(work)
    assert need.activations > 0 and need.state > 0 and need.inputs > 0
    assert need.total == pytest.approx(workload_memory(work))


def test_dry_run_refuses_512_hybrid_on_4_ranks(cli) -> None:
    code, out, err = cli("train", "--config", HYBRID_512, "--dry-run", "--ranks", "4")
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and "Traceback" not in err
    for part in ("layout D2H2 on 4 rank(s) (1 node x 4 ranks per node)", "per rank",
                 "activations", "MemAvailable on this node", "shared by 4 rank(s)",
                 "more ranks", "spatial split", "smaller train.batch_size"):
        assert part in line, part


def test_dry_run_prints_memory_of_a_layout_that_fits(cli) -> None:
    code, out, err = cli("train", "-c", "configs/tiny.yaml", "--dry-run", "--ranks", "4",
                         "--ranks-per-node", "2", "--set", "parallel.depth=2",
                         "--set", "parallel.height=2")
    assert code == 0, err
    assert "layout: D2H2 on 4 rank(s) = 2 nodes x 2 ranks per node" in out
    assert "memory per rank (planner's model, float32): activations" in out
    assert "parameters, gradients and optimizer state" in out
    assert "shared by 2 rank(s)" in out and out.rstrip().endswith("fits")
    code, out, err = cli("train", "-c", "configs/tiny.yaml", "--dry-run")  # this job
    assert code == 0 and "parameters held per rank" in out and "fits" in out, err


def test_dry_run_of_this_job_refuses_what_this_node_cannot_hold(
        cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dry_run, "mem_available", lambda: 2**20)  # a 1 MiB node
    code, _, err = cli("train", "-c", "configs/tiny.yaml", "--dry-run")
    assert code == 2 and "layout N1 on 1 rank(s) (1 node x 1 rank per node)" in err
    assert "1.0 MiB MemAvailable on this node" in err


def test_ranks_need_dry_run(cli) -> None:
    code, _, err = cli("train", "-c", "configs/tiny.yaml", "--ranks", "4")
    assert code == 2 and "only go with --dry-run" in err
