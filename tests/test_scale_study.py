"""``cosmotrain scale-study``: real studies of the tiny model under mpiexec (1 and 2 ranks,
3 steps each), the files they write, skipped and failed points, argument errors, the
report-only path, and the pure pieces (rank lists, strategy templates, launchers).

The studies run as subprocesses, like a user's; the driver must not start MPI itself (it
runs in a Slurm batch step), which one study checks from the inside.
"""

from __future__ import annotations

import csv
import json
import shutil
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, mpiexec, subprocess_env

from cosmotrain.config.layout import Layout as Strategy
from cosmotrain.study.launch import Launcher, find_launcher, slurm_tasks_per_node
from cosmotrain.study.points import build_points, parse_ranks, point_batch, spatial_strategy
from cosmotrain.study.report import CSV_COLUMNS, document, markdown
from cosmotrain.train.outputs.metrics import TIME_KEYS

TINY = str(REPO / "configs/tiny.yaml")
SMALL = ["--set", "model.width=12", "--set", "train.batch_size=4"]
STRONG_PLOTS = ("throughput.png", "speedup.png", "breakdown.png", "predicted.png")


def study(*args: str, env: dict | None = None, timeout: float = 120
          ) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cosmotrain", "scale-study", "--config", TINY, *SMALL,
               "--steps", "3", *args]
    return subprocess.run(command, cwd=REPO, env={**subprocess_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def by_name(doc: dict) -> dict[str, dict]:
    return {p["name"]: p for p in doc["points"]}


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk (which must be there)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def strong(tmp_path_factory) -> Path:
    """N1, N2, D2 measured and priced on the h100 preset; N3 cannot take a batch of 4."""
    mpiexec()
    out = tmp_path_factory.mktemp("strong") / "study"
    done = study("--ranks", "1,2,3", "--strategies", "N1,N2,D2,N3", "--machine", "h100",
                 "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_strong_study_measures_every_point(strong: Path) -> None:
    doc = results(strong)
    assert doc["mode"] == "strong" and doc["ranks"] == [1, 2, 3] and doc["launcher"] == "mpiexec"
    points = by_name(doc)
    assert list(points) == ["p1-N1", "p2-N2", "p2-D2", "p3-N3"]
    for name in ("p1-N1", "p2-N2", "p2-D2"):
        point = points[name]
        assert point["status"] == "ok" and point["batch"] == 4 and point["exit_code"] == 0
        measured = point["measured"]
        records = [json.loads(line) for line in
                   (strong / "points" / name / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in records if r["kind"] == "train" and r["step"] > 1]
        assert measured["steps_used"] == 2 and measured["step_times_s"] == times
        assert measured["step_s"] == statistics.median_low(times) > 0
        assert set(measured["time_s"]) == set(TIME_KEYS)
        assert sum(measured["time_s"].values()) == pytest.approx(measured["step_s"])
        assert measured["samples_per_s"] == pytest.approx(4 / measured["step_s"])
        assert measured["memory_hwm_mib_max"] > 0
        predicted = point["predicted"]
        assert predicted["step_s"] > 0 and predicted["samples_per_s"] > 0
        assert sum(predicted["time_s"].values()) == pytest.approx(predicted["step_s"])
        assert point["error_pct"] == pytest.approx(
            100 * (predicted["step_s"] / measured["step_s"] - 1))
        assert not (strong / "points" / name / "checkpoints").exists()
    assert doc["baseline"] == "p1-N1" and points["p1-N1"]["speedup"] == 1.0
    two = points["p2-D2"]
    assert two["speedup"] == pytest.approx(points["p1-N1"]["measured"]["step_s"] /
                                           two["measured"]["step_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert points["p2-D2"]["predicted"]["time_s"]["halo"] > 0  # D2 exchanges halos


def test_each_point_runs_its_strategy_on_the_shared_data(strong: Path) -> None:
    points = by_name(results(strong))
    command = points["p2-D2"]["command"]
    assert command[1:3] == ["-n", "2"] and command[3:6] == [sys.executable, "-m", "cosmotrain"]
    sets = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    for item in ("parallel.depth=2", "parallel.sample=1", "train.batch_size=4",
                 "train.max_steps=3", "train.log_every=1", "train.validate_every=0",
                 "data.source=files", f"data.path={strong / 'data'}",
                 f"output.dir={strong / 'points' / 'p2-D2'}"):
        assert item in sets
    manifest = json.loads((strong / "data" / "manifest.json").read_text())
    assert manifest["width"] == 12 and manifest["splits"]["train"]["count"] >= 4 * 3


def test_a_strategy_that_cannot_run_is_skipped_with_the_reason(strong: Path) -> None:
    skipped = by_name(results(strong))["p3-N3"]
    assert skipped["status"] == "skipped" and skipped["measured"] is None
    assert "train.batch_size" in skipped["reason"] and "3 sample group" in skipped["reason"]
    assert not (strong / "points" / "p3-N3").exists()  # never launched
    assert "- p3-N3 (skipped): config key 'train.batch_size'" in \
        (strong / "results.md").read_text()


def test_csv_and_markdown_tables(strong: Path) -> None:
    doc = by_name(results(strong))
    with open(strong / "results.csv", newline="") as file:
        reader = csv.DictReader(file)
        assert reader.fieldnames == CSV_COLUMNS
        rows = {row["name"]: row for row in reader}
    assert list(rows) == list(doc)
    assert float(rows["p2-N2"]["step_s"]) == pytest.approx(doc["p2-N2"]["measured"]["step_s"])
    assert float(rows["p2-N2"]["predicted_step_s"]) > 0
    assert rows["p3-N3"]["status"] == "skipped" and rows["p3-N3"]["step_s"] == ""
    text = (strong / "results.md").read_text()
    assert "| ranks | strategy | batch | step s | predicted s | error % |" in text
    n1 = next(line for line in text.splitlines() if line.startswith("| 1 | N1 |"))
    assert f"| {doc['p1-N1']['measured']['step_s']:.4g} |" in n1 and "| 1.00 | 1.00 |" in n1
    assert any(line.startswith("| 2 | D2 | 4 |") and line.endswith("| ok |")
               for line in text.splitlines())
    assert "relative to p1-N1" in text and "'h100'" in text


def test_plots_are_png_files(strong: Path) -> None:
    for name in STRONG_PLOTS:
        width, height = png_size(strong / name)
        assert width > 300 and height > 200


def test_report_rerenders_from_results_json_alone(strong: Path, tmp_path: Path, cli) -> None:
    shutil.copy(strong / "results.json", tmp_path / "results.json")
    code, out, err = cli("scale-study", "--report", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / "results.md").read_text() == (strong / "results.md").read_text()
    assert (tmp_path / "results.csv").read_text() == (strong / "results.csv").read_text()
    for name in STRONG_PLOTS:
        png_size(tmp_path / name)
    assert "wrote" in out and "results.md" in out


def test_report_with_a_machine_prices_the_points_again(strong: Path, tmp_path: Path,
                                                       cli) -> None:
    shutil.copy(strong / "results.json", tmp_path / "results.json")
    before = json.loads((tmp_path / "results.json").read_text())
    code, _, err = cli("scale-study", "--report", str(tmp_path), "--machine", "a100")
    assert code == 0, err
    after = json.loads((tmp_path / "results.json").read_text())
    assert after["machine"] == "a100" and after["notes"][-1].endswith("on a100")
    for old, new in zip(before["points"], after["points"]):
        assert new["measured"] == old["measured"]  # nothing was run again
        if new["status"] == "ok":
            assert new["predicted"]["step_s"] > 0
            assert new["predicted"] != old.get("predicted")
    code, _, _ = cli("scale-study", "--report", str(tmp_path), "--machine", "a100")
    assert json.loads((tmp_path / "results.json").read_text())["notes"] == after["notes"]


def test_without_matplotlib_everything_but_the_plots(strong: Path, tmp_path: Path, cli,
                                                     monkeypatch) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails
    monkeypatch.delitem(sys.modules, "cosmotrain.study.plots", raising=False)
    shutil.copy(strong / "results.json", tmp_path / "results.json")
    code, out, err = cli("scale-study", "--report", str(tmp_path))
    assert code == 0, err
    assert (tmp_path / "results.md").is_file() and (tmp_path / "results.csv").is_file()
    assert not list(tmp_path.glob("*.png"))
    [hint] = [line for line in out.splitlines() if "plots skipped" in line]
    assert "matplotlib, a dependency of cosmotrain, cannot be imported" in hint
    assert "reinstall cosmotrain (pip install -e .)" in hint


def test_weak_study_scales_the_batch_without_mpi_in_the_driver(tmp_path: Path) -> None:
    """Weak: batch 4 x P.  The driver runs in-process here and reports whether it loaded
    mpi4py.MPI (which would initialise MPI in a Slurm batch step)."""
    mpiexec()
    out = tmp_path / "weak"
    code = ("import sys\nfrom cosmotrain.cli import main\n"
            f"sys.argv = ['cosmotrain', 'scale-study', '--config', {TINY!r}, "
            f"'--set', 'model.width=12', '--steps', '3', '--ranks', '1,2', '--mode', "
            f"'weak', '--strategies', 'data', '--machine', 'none', '--out', {str(out)!r}]\n"
            "try:\n    main()\nfinally:\n"
            "    print('mpi4py.MPI loaded:', 'mpi4py.MPI' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mpi4py.MPI loaded: False" in done.stdout
    points = by_name(results(out))
    assert [(p["strategy"], p["batch"], p["status"]) for p in points.values()] == \
        [("N1", 4, "ok"), ("N2", 8, "ok")]
    assert all(p["predicted"] is None and p["efficiency"] > 0 for p in points.values())
    assert points["p2-N2"]["efficiency"] == pytest.approx(
        points["p1-N1"]["measured"]["step_s"] / points["p2-N2"]["measured"]["step_s"])
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["splits"]["train"]["count"] >= 8 * 3
    text = (out / "results.md").read_text()
    assert "batch 4 per rank (global batch 4 x P)" in text and "--machine none" in text
    for name in ("throughput.png", "efficiency.png", "breakdown.png"):
        png_size(out / name)
    assert not (out / "predicted.png").exists()  # nothing predicted


def test_a_failed_point_is_recorded_and_the_study_goes_on(strong: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "faulty"
    done = study("--ranks", "1,2", "--strategies", "data", "--machine", "none",
                 "--data", str(strong / "data"), "--out", str(out),
                 env={"COSMOTRAIN_FAULT": "1:1"})  # rank 1 raises before its 2nd step
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 point(s) failed: p2-N2" in done.stderr
    points = by_name(results(out))
    assert points["p1-N1"]["status"] == "ok"
    failed = points["p2-N2"]
    assert failed["status"] == "failed" and failed["exit_code"] not in (0, 2)
    assert "fault injected" in failed["stderr_tail"]
    assert failed["reason"] == "RuntimeError: fault injected by COSMOTRAIN_FAULT=1:1"
    assert "- p2-N2 (failed, exit" in (out / "results.md").read_text()
    assert not (out / "data").exists()  # --data: nothing generated


def test_a_run_the_trainer_refuses_is_skipped(strong: Path, tmp_path: Path) -> None:
    """The checks before launching pass, but the 12^3 data cannot feed 16^3 samples."""
    out = tmp_path / "refused"
    done = study("--ranks", "1", "--strategies", "N1", "--machine", "none", "--set",
                 "model.width=16", "--data", str(strong / "data"), "--out", str(out))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no point could run" in done.stderr
    [point] = results(out)["points"]
    assert point["status"] == "skipped" and point["exit_code"] == 2
    assert point["reason"].startswith("cosmotrain train refused it: config key 'model.width'")


def test_an_earlier_study_is_refused_or_moved_aside(strong: Path, tmp_path: Path) -> None:
    """Run again into its --out, a study would have replaced the earlier results with
    skipped points: refused before anything runs; --overwrite moves them aside."""
    out = tmp_path / "again"
    args = ("--ranks", "1", "--strategies", "N1", "--machine", "none", "--out", str(out))
    first = study(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    earlier = (out / "results.json").read_text()
    refused = study(*args)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.count(f"--out '{out}' holds an earlier study (results.json") == 1
    assert "--overwrite to move it into" in refused.stderr and not refused.stdout
    assert (out / "results.json").read_text() == earlier
    moved = study(*args, "--overwrite")
    assert moved.returncode == 0, moved.stdout + moved.stderr
    [previous] = out.glob("previous-*")
    assert (previous / "results.json").read_text() == earlier
    assert (previous / "points/p1-N1/metrics.jsonl").is_file()
    assert "reusing the dataset" in moved.stdout and (out / "data").is_dir()
    assert by_name(results(out))["p1-N1"]["status"] == "ok"


def test_a_stopped_study_resumes_with_the_points_it_lacks(strong: Path, tmp_path: Path) -> None:
    """An allocation ended during p2-N2: --resume keeps p1-N1 (not run again), runs
    p2-N2 after setting its interrupted attempt aside; other settings are refused."""
    out = tmp_path / "stopped"
    args = ("--ranks", "1,2", "--strategies", "data", "--machine", "none", "--data",
            str(strong / "data"), "--out", str(out))
    first = study(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    doc = results(out)
    n2 = by_name(doc)["p2-N2"]
    n2.update(status="pending", measured=None)  # as results.json stands mid-point
    (out / "results.json").write_text(json.dumps(doc))
    n1_metrics = (out / "points/p1-N1/metrics.jsonl").read_bytes()
    refused = study(*args, "--steps", "4")
    assert refused.returncode == 2 and "pass --resume to measure only" in refused.stderr
    other = study(*args, "--steps", "4", "--resume")
    assert other.returncode == 2, other.stdout + other.stderr
    assert "--resume: the study in --out" in other.stderr and "steps 3" in other.stderr
    resumed = study(*args, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "1 point(s) to run, 0 skipped, 1 measured before (--resume)" in resumed.stdout
    points = by_name(results(out))
    assert points["p1-N1"]["status"] == points["p2-N2"]["status"] == "ok"
    assert points["p1-N1"]["measured"] == by_name(doc)["p1-N1"]["measured"]
    assert (out / "points/p1-N1/metrics.jsonl").read_bytes() == n1_metrics
    [aside] = (out / "points").glob("p2-N2.previous-*")
    assert (aside / "metrics.jsonl").is_file()  # the interrupted attempt, kept
    both = study(*args, "--resume", "--overwrite")
    assert both.returncode == 2 and "pass one of them" in both.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--ranks", "0,2"], "--ranks '0,2'"),
    (["--ranks", "1,x"], "--ranks '1,x'"),
    (["--ranks", "1", "--strategies", "N2x"], "strategy 'N2x' is not understood"),
    (["--ranks", "1", "--strategies", "D2"], "D2 needs 2 rank(s)"),
    (["--ranks", "1", "--strategies", "plan", "--machine", "none"], "plan needs a machine"),
    (["--ranks", "1", "--machine", "no/such.json"], "no/such.json"),
    (["--ranks", "1", "--steps", "3", "--warmup", "3"], "--warmup 3"),
    (["--ranks", "1", "--data", "no/such/dir"], "--data no/such/dir"),
])
def test_bad_arguments_exit_2_with_one_line(cli, tmp_path: Path, args, fragment) -> None:
    code, _, err = cli("scale-study", "--config", TINY, "--out", str(tmp_path / "o"), *args)
    assert code == 2, err
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_missing_options_and_report_errors_exit_2(cli, tmp_path: Path) -> None:
    code, _, err = cli("scale-study", "--ranks", "1")
    assert code == 2 and "needs --config, --out" in err
    code, _, err = cli("scale-study", "--report", str(tmp_path))
    assert code == 2 and "results.json" in err
    code, _, err = cli("scale-study", "--config", TINY, "--ranks", "1", "--out", "x",
                       "--mode", "medium")
    assert code == 2 and "medium" in err


def test_no_point_that_can_run_exits_2_with_the_reasons(cli, tmp_path: Path) -> None:
    code, _, err = cli("scale-study", "--config", TINY, "--ranks", "3", "--strategies", "N3",
                       "--machine", "none", "--out", str(tmp_path))
    assert code == 2 and "no point could run" in err
    doc = results(tmp_path)
    assert [p["status"] for p in doc["points"]] == ["skipped"]
    assert not (tmp_path / "data").exists()


# --- pure pieces --------------------------------------------------------------------------


def test_parse_ranks_sorts_and_deduplicates() -> None:
    assert parse_ranks("8,1 2,,4,2") == (1, 2, 4, 8)


@pytest.mark.parametrize("ranks, name", [(1, "N1"), (2, "D2"), (4, "D2H2"), (8, "D2H2W2"),
                                         (16, "D4H2W2"), (12, "D3H2W2"), (6, "D3H2")])
def test_spatial_strategy_splits_depth_then_height_then_width(ranks: int, name: str) -> None:
    assert spatial_strategy(ranks).describe() == name


def test_points_from_templates_are_merged_per_rank_count() -> None:
    points = build_points(["data", "spatial", "plan", "N2"], [1, 2], 4, "weak",
                          lambda ranks, batch: Strategy(depth=ranks))
    assert [(p.ranks, p.strategy, p.batch, p.origin) for p in points] == [
        (1, "N1", 4, ["data", "spatial", "plan"]),
        (2, "N2", 8, ["data", "N2"]), (2, "D2", 8, ["spatial", "plan"])]
    assert point_batch(4, 8, "strong") == 4 and point_batch(4, 8, "weak") == 32


def measured_doc(names: list[str], ranks: list[int]) -> dict:
    """A weak-scaling results document of ``names`` with made-up timings (halo and
    compute only: the zero phases are stacked on top of each bar)."""
    points = build_points(names, ranks, 4, "weak", None)
    for i, point in enumerate(points):
        seconds = {key: 0.0 for key in TIME_KEYS} | {"compute": 0.5, "halo": 0.1 * i}
        point.status = "ok"
        point.measured = {"step_s": sum(seconds.values()), "time_s": seconds,
                          "samples_per_s": point.batch / sum(seconds.values()),
                          "comm_share": 0.0, "memory_hwm_mib_max": 100.0}
    return document({"mode": "weak", "config": "tiny.yaml", "model": "tiny", "width": 8,
                     "base_batch": 4, "steps": 3, "warmup": 1, "launcher": "mpiexec",
                     "points": points})


def test_legends_name_the_strategies_as_the_table_does() -> None:
    from cosmotrain.study.plots import scaling_figure, throughput_figure

    doc = measured_doc(["N1", "N2", "N4", "C2F2:w"], [1, 2, 4])
    ok = doc["points"]
    base = next(p for p in ok if p["name"] == doc["baseline"])
    table = {line.split("|")[2].strip() for line in markdown(doc).splitlines()
             if line.startswith("| ") and line[2].isdigit()}
    assert table == {"N1", "N2", "N4", "C2F2:w"}
    for fig in (scaling_figure(doc, ok, base, "efficiency"), throughput_figure(doc, ok, base)):
        legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        assert legend == ["N1, N2, N4", "C2F2:w", "ideal"]  # the baseline N1 starts both
        assert {name for label in legend[:-1] for name in label.split(", ")} == table


def test_the_breakdown_has_headroom_above_the_tallest_bar() -> None:
    from cosmotrain.study.plots import breakdown_figure

    doc = measured_doc(["data"], [1, 2, 4])
    tallest = max(p["measured"]["step_s"] for p in doc["points"])
    bars = breakdown_figure(doc["points"]).axes[0]
    assert max(patch.get_y() + patch.get_height() for patch in bars.patches) == \
        pytest.approx(tallest)
    assert bars.get_ylim() == (0.0, pytest.approx(1.12 * tallest))


def test_srun_inside_an_allocation(tmp_path: Path) -> None:
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    env = {"PATH": str(tmp_path), "SLURM_JOB_ID": "42", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    launcher = find_launcher("auto", env=env)
    assert launcher == Launcher("srun", str(srun), 4)
    assert launcher.words(8) == [str(srun), "--ntasks=8", "--nodes=2", "--ntasks-per-node=4"]
    assert launcher.words(2) == [str(srun), "--ntasks=2", "--nodes=1", "--ntasks-per-node=2"]
    assert find_launcher("auto", 2, env).words(4)[2:] == ["--nodes=2", "--ntasks-per-node=2"]
    assert slurm_tasks_per_node({}) is None
