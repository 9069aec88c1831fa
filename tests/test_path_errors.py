"""Path problems and absurd arguments are one line (exit 2), never a traceback or minutes
of work: an output under a file or on a read-only filesystem, a name too long, a metrics
file that is not UTF-8, a rank count no strategy can have, a directory given as a config,
a dataset mixing formats; files are named as what they are (a checkpoint, a machine file),
and a killed staging's hidden temporaries are removed by the next successful one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import REPO
from test_write_failures import small_fs  # noqa: F401  (the fixture: a tmpfs, ro or not)

TINY = str(REPO / "configs" / "tiny.yaml")


def one_line(code: int, err: str, *fragments: str) -> None:
    """Exit 2 and one error line holding every fragment; no traceback."""
    assert code == 2, err
    assert err.count("cosmotrain: error:") == 1 and "Traceback" not in err, err
    line = next(line for line in err.splitlines() if "cosmotrain: error:" in line)
    for fragment in fragments:
        assert fragment in line, err


@pytest.fixture
def data(cli, tmp_path: Path) -> Path:
    code, _, err = cli("datagen", "--out", str(tmp_path / "d"), "--samples", "4",
                       "--width", "8", "--seed", "2")
    assert code == 0, err
    return tmp_path / "d"


def preload(cli, data: Path, dest: Path) -> tuple[int, str, str]:
    return cli("preload", "--set", f"data.path={data}", "--set", "model.width=8",
               "--dest", str(dest))


def test_outputs_under_a_file_or_on_a_read_only_filesystem(cli, tmp_path: Path, data: Path,
                                                           small_fs) -> None:  # noqa: F811
    blocker = tmp_path / "afile"
    blocker.write_text("keep me\n")
    code, _, err = preload(cli, data, blocker / "stage")
    one_line(code, err, f"cannot write '{blocker / 'stage'}'", "is a file, not a directory",
             "--dest")
    code, _, err = cli("scale-study", "--config", TINY, "--ranks", "1", "--out",
                       str(blocker / "study"))
    one_line(code, err, f"'{blocker / 'study'}'", "is a file, not a directory", "--out")
    assert blocker.read_text() == "keep me\n"
    read_only = small_fs("512k", readonly=True)
    code, _, err = preload(cli, data, read_only / "stage")
    one_line(code, err, f"'{read_only / 'stage'}'", "Read-only file system", "--dest")
    long = tmp_path / ("x" * 300)
    code, _, err = cli("train", "--config", TINY, "--set", "data.source=files", "--set",
                       f"data.path={data}", "--set", "model.width=8", "--set",
                       f"output.dir={long}")
    one_line(code, err, "File name too long", "choose a shorter output.dir")


def test_a_metrics_file_that_is_not_utf8_is_named(cli, tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    code, _, err = cli("report", str(tmp_path))
    one_line(code, err, f"metrics file '{tmp_path / 'metrics.jsonl'}': is not UTF-8 text")
    assert not (tmp_path / "plots").exists()


def test_a_rank_count_no_strategy_can_have_is_refused_before_enumerating(
        cli, monkeypatch: pytest.MonkeyPatch) -> None:
    from cosmotrain.plan import planner

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the planner enumerated the strategies of an absurd rank count")
    monkeypatch.setattr(planner, "enumerate_strategies", never)
    sets = ["--set", "model.width=8", "--set", "train.batch_size=4"]
    code, _, err = cli("plan", "--config", TINY, *sets, "--ranks", "1000000000")
    one_line(code, err, "no strategy for 1000000000 rank(s): at most 128 can share a batch "
             "of 4 cubes of width 8")
    code, _, err = cli("train", "--config", TINY, *sets, "--set", "parallel=auto",
                       "--dry-run", "--ranks", "1000000000")
    one_line(code, err, "no strategy for 1000000000 rank(s)", "train.batch_size")


def test_most_ranks_is_the_largest_count_with_a_strategy() -> None:
    from cosmotrain.plan.strategy import divisors, enumerate_strategies, most_ranks

    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(1) == [1]
    limit = most_ranks(4, 8, 4)  # 4 sample groups x 4 channel/filter x 2^3 blocks
    assert limit == 128 and list(enumerate_strategies(limit, 4, 8, 4))
    assert not list(enumerate_strategies(2 * limit, 4, 8, 4))


def test_a_config_directory_and_a_mixed_dataset_say_what_they_are(cli, tmp_path: Path,
                                                                  data: Path) -> None:
    code, _, err = cli("train", "-c", str(REPO / "configs"))
    one_line(code, err, f"config file '{REPO / 'configs'}' is a directory")
    code, _, err = cli("convert", "--data", str(data), "--out", str(tmp_path / "npy"),
                       "--format", "npy")
    assert code == 0, err
    (data / "manifest.json").unlink()  # scanned, as a downloaded dataset
    npy = next((tmp_path / "npy" / "train").glob("*_data.npy"))
    os.rename(npy, data / "train" / npy.name)
    code, _, err = cli("train", "--config", TINY, "--set", "data.source=files", "--set",
                       f"data.path={data}", "--set", "model.width=8", "--set",
                       f"output.dir={tmp_path / 'run'}")
    one_line(code, err, f"dataset '{data}': mixes sample files of formats hdf5, npy")


def test_a_killed_stagings_hidden_temporaries_go_with_the_next_success(
        cli, tmp_path: Path, data: Path) -> None:
    dest = tmp_path / "stage"
    code, _, err = preload(cli, data, dest)
    assert code == 0, err
    staged = sorted((dest / "train").glob("*.hdf5"))[0]
    left = staged.with_name(f".{staged.name}.4242.0123abcd.tmp")  # a killed copy's
    live = staged.with_name(f".{staged.name}.4343.89abcdef.tmp")  # a copy still writing
    for path in (left, live):
        path.write_bytes(b"half a copy")
    hour_ago = time.time() - 3600
    os.utime(left, (hour_ago, hour_ago))
    staged.write_bytes(b"damaged")  # the rerun has work to do
    code, _, err = preload(cli, data, dest)
    assert code == 0, err
    assert not left.exists() and live.exists()
    assert staged.read_bytes() == (data / staged.relative_to(dest)).read_bytes()
