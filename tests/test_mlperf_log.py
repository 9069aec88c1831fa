"""``output.mlperf_log``: the MLPerf HPC v3.0 CosmoFlow log (docs/OBSERVABILITY.md).

A short run of the reference network with SGD, on a dataset staged by ``cosmotrain
preload``, writes a log the package's compliance checker accepts but for the quality
target; only rank 0 writes; the keys carry the config's values; a resumed run appends a
second, complete segment; a missing package is one line naming the extra.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, mpiexec, subprocess_env
from test_data_manifest import write_universes

from cosmotrain.device.select import Device
from cosmotrain.errors import WriteError
from cosmotrain.train.outputs.mlperf_writer import MLPerfLog
from cosmotrain.train.outputs.mlperf import accelerators_per_node, warmup_factor
from cosmotrain.train.outputs.observers import RunStart

TINY = ["model.name=tiny", "model.width=8", "data.source=synthetic",
        "data.synthetic.samples=10", "data.synthetic.val_fraction=0.2", "train.batch_size=4",
        "train.log_every=1", "optimizer.name=sgd", "optimizer.lr=0.01",
        "output.mlperf_log=true"]
# what the checker prints when the run's log is compliant but for the quality target
TARGET_UNMET = ("WARNING -  Failed checks for eval_error : v['value'] <= 0.124 and "
                "v['value'] > 0.\nERROR - FAILED")


@pytest.fixture
def mllog() -> None:
    pytest.importorskip("mlperf_logging")


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def entries(path: Path) -> list[dict]:
    """The log's lines, parsed (every line must be an ``:::MLLOG`` line)."""
    lines = path.read_text().splitlines()
    assert all(line.startswith(":::MLLOG {") for line in lines), lines
    return [json.loads(line[len(":::MLLOG "):]) for line in lines]


def values(log: list[dict], key: str) -> list:
    return [entry["value"] for entry in log if entry["key"] == key]


def epochs(log: list[dict], key: str) -> list[int]:
    return [entry["metadata"]["epoch_num"] for entry in log if entry["key"] == key]


def entries_keys(path: Path, tolerant: bool = False) -> list[str]:
    keys = []
    for line in path.read_text().splitlines():
        try:
            keys.append(json.loads(line[len(":::MLLOG "):])["key"])
        except ValueError:
            assert tolerant, line
    return keys


def check(path: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """The documented command: the package's checker, HPC rules 3.0.0."""
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker",
                           "--usage", "hpc", "--ruleset", "3.0.0",
                           "--log_output", str(tmp_path / "checker.log"), str(path)],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())


def verdict(result: subprocess.CompletedProcess) -> str:
    """The checker's findings: its output less the INFO lines and the pointer to its log."""
    lines = (result.stdout + result.stderr).splitlines()
    return "\n".join(line for line in lines
                     if not line.startswith(("INFO -", "** Logging output also at")))


def test_staged_reference_run_passes_the_checker_but_for_the_target(
        cli, mllog, tmp_path: Path) -> None:
    source, stage, out = tmp_path / "universes", tmp_path / "stage", tmp_path / "run"
    write_universes(source, 32, 4, "channels-first", "float32")
    common = ["model.width=32", "train.batch_size=2", "output.mlperf_log=true",
              f"output.dir={out}", "output.mlperf.org=Cosmo Lab",
              "output.mlperf.platform=laptop"]
    code, _, err = cli("preload", *sets(f"data.path={source}", *common),
                       "--dest", str(stage))
    assert code == 0, err
    assert [e["key"] for e in entries(out / "mlperf.log")] == ["staging_start", "staging_stop"]
    code, _, err = cli("train", *sets(
        f"data.path={stage}", *common, "model.name=cosmoflow-mlperf", "model.dropout=0.5",
        "optimizer.name=sgd", "optimizer.lr=0.002", "optimizer.weight_decay=0.0001",
        "optimizer.schedule.name=step", "optimizer.schedule.warmup_epochs=1",
        "optimizer.schedule.warmup_start_lr=0.001", "optimizer.schedule.decay_epochs=1",
        "optimizer.schedule.decay_factors=0.5", "train.epochs=2", "train.max_steps=null"))
    assert code == 0, err
    log = entries(out / "mlperf.log")
    keys = [e["key"] for e in log]
    assert keys[:4] == ["staging_start", "staging_stop", "cache_clear", "init_start"]
    assert keys.index("init_stop") + 1 == keys.index("run_start") and keys[-1] == "run_stop"
    expected = {"submission_benchmark": "cosmoflow", "submission_org": "Cosmo Lab",
                "submission_division": "closed", "submission_status": "onprem",
                "submission_platform": "laptop", "number_of_nodes": 1,
                "accelerators_per_node": 0, "global_batch_size": 2, "train_samples": 4,
                "eval_samples": 1, "gradient_accumulation_steps": 1, "opt_name": "sgd",
                "opt_base_learning_rate": 0.002, "opt_learning_rate_warmup_epochs": 1,
                "opt_learning_rate_warmup_factor": 2.0,
                "opt_learning_rate_decay_boundary_epochs": [1],
                "opt_learning_rate_decay_factor": [0.5], "dropout": 0.5,
                "opt_weight_decay": 0.0001}
    assert {key: values(log, key) for key in expected} == \
        {key: [value] for key, value in expected.items()}
    assert epochs(log, "epoch_start") == epochs(log, "epoch_stop") == [1, 2]
    assert epochs(log, "eval_start") == epochs(log, "eval_stop") == [1, 2]
    assert epochs(log, "eval_error") == [1, 2]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert values(log, "eval_error") == [r["mae"] for r in metrics if r["kind"] == "validation"]
    assert log[-1]["metadata"]["status"] == "aborted"  # MAE ~0.4: the target is far

    result = check(out / "mlperf.log", tmp_path)
    assert result.returncode == 1 and verdict(result) == TARGET_UNMET, verdict(result)
    reached = out / "reached.log"  # the same log had its last validation reached 0.1
    text = (out / "mlperf.log").read_text().splitlines()
    last = max(i for i, line in enumerate(text) if '"key": "eval_error"' in line)
    entry = json.loads(text[last][len(":::MLLOG "):])
    text[last] = ":::MLLOG " + json.dumps({**entry, "value": 0.1})
    reached.write_text("\n".join(text) + "\n")
    result = check(reached, tmp_path)
    assert result.returncode == 0 and verdict(result) == "", verdict(result)
    assert "INFO - SUCCESS" in result.stderr


def test_reaching_train_target_mae_logs_success(tmp_path: Path, mllog,
                                                 cli) -> None:
    code, _, err = cli("train", *sets(*TINY, "train.epochs=3", "train.max_steps=null",
                                      "train.target_mae=10", f"output.dir={tmp_path}"))
    assert code == 0, err
    log = entries(tmp_path / "mlperf.log")
    assert epochs(log, "eval_error") == [1]  # the target stops the run after epoch 1
    assert log[-1]["key"] == "run_stop" and log[-1]["metadata"]["status"] == "success"


def test_only_rank_0_writes(tmp_path: Path, mllog) -> None:
    line = [sys.executable, "-m", "cosmotrain", "train",
            *sets(*TINY, "train.epochs=2", "train.max_steps=null", f"output.dir={tmp_path}")]
    done = subprocess.run([mpiexec(), "-n", "2", *line], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    log = entries(tmp_path / "mlperf.log")
    keys = [e["key"] for e in log]
    once = ["cache_clear", "init_start", "init_stop", "run_start", "run_stop",
            "submission_org", "global_batch_size", "number_of_nodes"]
    assert {key: keys.count(key) for key in once} == dict.fromkeys(once, 1)
    assert epochs(log, "epoch_start") == epochs(log, "eval_error") == [1, 2]
    assert values(log, "number_of_nodes") == [1] and values(log, "train_samples") == [8]


def test_a_resumed_run_appends_a_complete_segment(tmp_path: Path, mllog, cli) -> None:
    base = [*TINY, "train.epochs=2", "train.checkpoint_every_steps=1",
            "train.validate_every=1", f"output.dir={tmp_path}"]
    code, _, err = cli("train", *sets(*base, "train.max_steps=3"))
    assert code == 0, err
    first = (tmp_path / "mlperf.log").read_text()
    code, _, err = cli("train", *sets(*base, "train.max_steps=null"), "--resume")
    assert code == 0, err
    text = (tmp_path / "mlperf.log").read_text()
    assert text.startswith(first)  # the first attempt is kept as it was
    log = entries(tmp_path / "mlperf.log")
    keys = [e["key"] for e in log]
    assert keys.count("init_start") == keys.count("run_start") == keys.count("run_stop") == 2
    second = log[[i for i, key in enumerate(keys) if key == "cache_clear"][1]:]
    assert [e["key"] for e in second[:2]] == ["cache_clear", "init_start"]
    assert epochs(second, "epoch_start") == [2]  # the epoch it resumes into
    assert epochs(log, "epoch_stop") == [1, 2]  # the first attempt stopped within epoch 2
    segment = tmp_path / "second.log"
    segment.write_text("".join(line + "\n" for line in text.splitlines()[len(
        first.splitlines()):]))
    result = check(segment, tmp_path)
    assert verdict(result) == TARGET_UNMET, verdict(result)  # a whole log on its own


def test_overwrite_keeps_the_previous_runs_log(tmp_path: Path, mllog, cli) -> None:
    """--overwrite moves the earlier run's mlperf.log aside with its checkpoints and
    metrics; the new run's log starts afresh in output.dir."""
    base = [*TINY, "train.epochs=1", f"output.dir={tmp_path}"]
    code, _, err = cli("train", *sets(*base))
    assert code == 0, err
    first = (tmp_path / "mlperf.log").read_text()
    code, _, err = cli("train", *sets(*base), "--overwrite")
    assert code == 0, err
    (previous,) = tmp_path.glob("previous-*")
    assert (previous / "mlperf.log").read_text() == first
    keys = [e["key"] for e in entries(tmp_path / "mlperf.log")]
    assert keys.count("run_start") == keys.count("run_stop") == 1


def test_a_fresh_log_keeps_only_the_staging_lines_at_its_end(tmp_path: Path,
                                                             mllog) -> None:
    path = tmp_path / "mlperf.log"
    old = MLPerfLog(path)
    for key in ("staging_start", "staging_stop", "init_start", "run_start"):
        old.event(key)
    old.close()
    path.write_text(path.read_text() + ":::MLLOG {\"key\": \"torn")  # a crash mid-line
    staged = MLPerfLog(path)  # appending: the torn line is ended first
    staged.start("staging_start")
    staged.end("staging_stop")
    staged.close()
    assert [line.startswith(":::MLLOG {\"key\": \"torn") for line in
            path.read_text().splitlines()].count(True) == 1
    assert entries_keys(path, tolerant=True)[-2:] == ["staging_start", "staging_stop"]
    fresh = MLPerfLog(path, fresh=True)
    fresh.event("cache_clear")
    fresh.close()
    assert [e["key"] for e in entries(path)] == ["staging_start", "staging_stop",
                                                 "cache_clear"]
    assert entries(path)[0]["metadata"]["file"].endswith("test_mlperf_log.py")  # call site


def test_a_refused_write_names_the_file(tmp_path: Path, mllog,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import cosmotrain.train.outputs.mlperf_writer as mlperf_file

    log = MLPerfLog(tmp_path / "mlperf.log")
    log.event("init_start")
    monkeypatch.setattr(mlperf_file, "write_all",
                        lambda fd, data: (_ for _ in ()).throw(OSError(28, "No space")))
    with pytest.raises(WriteError, match="mlperf.log"):
        log.event("run_start")
    log.close()
    assert [e["key"] for e in entries(tmp_path / "mlperf.log")] == ["init_start"]


@pytest.mark.parametrize("command", ["train", "preload"])
def test_missing_package_is_one_line_naming_the_extra(
        cli, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlperf_logging", None)  # find_spec: not installed
    code, _, err = cli(command, *sets(*TINY, f"output.dir={tmp_path / 'run'}",
                                      f"data.path={tmp_path}"))
    assert code == 2
    assert err.strip().count("\n") == 0
    assert 'pip install -e ".[mlperf]"' in err and "output.mlperf_log" in err
    assert not (tmp_path / "run" / "mlperf.log").exists()


def test_settings_follow_the_reference_conventions() -> None:
    from cosmotrain.config.load import load_config

    run = RunStart(None, Path("."), 8, 2, 4, 1, 1, 1, 0, False,  # type: ignore[arg-type]
                   Device(kind="gpu", index=0, shared_by=2))
    assert accelerators_per_node(run) == 2  # 4 ranks a node, 2 on each GPU
    assert accelerators_per_node(dataclasses.replace(run, device=Device())) == 0  # CPU
    assert accelerators_per_node(dataclasses.replace(run, device=None)) == 0
    cfg = load_config(None, ["optimizer.lr=0.004", "optimizer.schedule.warmup_epochs=4",
                             "optimizer.schedule.warmup_start_lr=0.001"])
    assert warmup_factor(cfg) == 4.0  # the reference: peak over the warm-up's start
    cfg.optimizer.schedule.warmup_epochs = 0
    assert warmup_factor(cfg) == 1.0


def test_checker_is_installed_where_the_docs_say(mllog) -> None:
    """docs/OBSERVABILITY.md gives this command; it must name rules the package has."""
    import mlperf_logging

    rules = Path(mlperf_logging.__file__).parent / "compliance_checker" / "hpc_3.0.0"
    assert (rules / "closed_cosmoflow.yaml").is_file()
    doc = (REPO / "docs" / "OBSERVABILITY.md").read_text()
    assert "python -m mlperf_logging.compliance_checker --usage hpc --ruleset 3.0.0" in doc
