"""``cosmotrain report RUN_DIR``: PNGs of a run's loss, validation MAE, throughput and time
breakdown from its metrics.jsonl, one curve per quantity even across an interrupted and
resumed run, and one-line errors for what is missing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO
from matplotlib.figure import Figure  # a dependency: the README's install has it, no skip
from mpi4py import MPI

from cosmotrain.config.load import load_config
from cosmotrain.errors import UserError
from cosmotrain.study import run_plots
from cosmotrain.study.run_plots import joined, load_curves, write_run_plots
from cosmotrain.train import run as runner
from cosmotrain.train.checkpoints.checkpoint import checkpoint_dir, list_checkpoints
from cosmotrain.train.outputs.metrics import TIME_KEYS, metrics_path, read_metrics

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
ALL_PLOTS = ["loss.png", "validation_mae.png", "throughput.png", "breakdown.png"]


def train(out: Path, *extra: str, resume: bool = False) -> None:
    cfg = load_config(TINY, ["data.source=synthetic", "data.synthetic.samples=10",
                             "data.synthetic.val_fraction=0.2", "model.width=8",
                             "train.batch_size=4", "train.log_every=1", "train.epochs=3",
                             "train.checkpoint_every_steps=1", f"output.dir={out}", *extra])
    runner.run_training(cfg, MPI.COMM_WORLD, resume=resume)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1-4 logged, the checkpoints after step 2 lost (a crash), resumed to step 6."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    train(out, "train.max_steps=4")
    for step, path in list_checkpoints(checkpoint_dir(out)):
        if step > 2:
            path.unlink()
    train(out, "train.max_steps=null", resume=True)
    return out


def test_report_of_a_short_run(tmp_path: Path, cli) -> None:
    out = tmp_path / "run"
    train(out, "train.max_steps=2")
    code, stdout, err = cli("report", str(out))
    assert code == 0, err
    assert "wrote 4 plot(s)" in stdout
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted(ALL_PLOTS)
    for name in ALL_PLOTS:
        assert_png(out / "plots" / name)


def test_a_resumed_run_gives_one_curve(resumed: Path, tmp_path: Path, cli) -> None:
    code, _, err = cli("report", str(resumed), "--out", str(tmp_path / "pngs"))
    assert code == 0, err
    for name in ALL_PLOTS:
        assert_png(tmp_path / "pngs" / name)
    curves = load_curves(resumed)
    assert [r["step"] for r in curves.train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in curves.validation] == [2, 4, 6]
    lines = drawn(run_plots.draw_loss, curves)
    assert list(lines[0].get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(lines[0].get_ydata()) == [r["loss"] for r in curves.train]
    assert list(drawn(run_plots.draw_throughput, curves)[0].get_xdata()) == [1, 2, 3, 4, 5, 6]
    mean = drawn(run_plots.draw_validation, curves)[-1]
    assert mean.get_label() == "mean" and list(mean.get_xdata()) == [2, 4, 6]


def drawn(draw, curves) -> list:
    fig = Figure()
    draw(fig, curves)
    return fig.axes[0].get_lines()


def test_a_log_that_was_never_cut_back_is_joined(resumed: Path, tmp_path: Path) -> None:
    """A continuation appended without the resume's cut-back (steps 3, 4 logged twice):
    the later records replace the earlier ones from their first step on."""
    records = read_metrics(metrics_path(resumed))
    train_records = [r for r in records if r["kind"] == "train"]
    stale = [dict(r, loss=99.0) for r in train_records if r["step"] in (3, 4)]
    lines = [*train_records[:4], *stale, *train_records[2:]]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 3, 4, 3, 4, 5, 6]
    curve = joined(lines)
    assert [r["step"] for r in curve] == [1, 2, 3, 4, 5, 6]
    assert 99.0 not in [r["loss"] for r in curve]
    run = tmp_path / "uncut"
    run.mkdir()
    metrics_path(run).write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["step"] for r in load_curves(run).train] == [1, 2, 3, 4, 5, 6]
    assert len(write_run_plots(run)) == 3  # no validation record: no MAE plot


def test_the_breakdown_has_headroom_above_the_tallest_step(resumed: Path) -> None:
    curves = load_curves(resumed)
    fig = Figure()
    run_plots.draw_breakdown(fig, curves)
    tallest = max(sum(r["time_s"][k] for k in TIME_KEYS) for r in curves.train)
    assert fig.axes[0].get_ylim()[1] >= 1.1 * tallest


def test_missing_inputs_are_one_line_errors(tmp_path: Path, cli,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = cli("report", str(tmp_path / "nowhere"))
    assert code == 2 and "run directory" in err and "not found" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = cli("report", str(tmp_path))
    assert code == 2 and "has no metrics.jsonl" in err
    metrics_path(tmp_path).write_text("")
    with pytest.raises(UserError, match="no train record"):
        load_curves(tmp_path)
    run = tmp_path / "run"
    train(run, "train.max_steps=1")
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    code, _, err = cli("report", str(run))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "matplotlib" in err and "reinstall cosmotrain (pip install -e .)" in err
    assert not (run / "plots").exists()


def test_the_readmes_install_brings_what_the_plots_need() -> None:
    """Every `pip install -e ".[...]"` line of the README installs matplotlib: the plots of
    report and scale-study (tested above and in test_scale_study.py) work on it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    readme = (REPO / "README.md").read_text()
    installs = re.findall(r'pip install -e "\.(?:\[([\w,-]+)\])?"', readme)
    assert installs and "mpich" in installs
    for extras in installs:
        wanted = list(project["dependencies"])
        for extra in filter(None, extras.split(",")):
            wanted += project["optional-dependencies"][extra]
        assert any(re.match(r"matplotlib\b", item) for item in wanted), extras
