"""Bad numbers and shapes in input files: one line naming the file, exit 2, printed once.

Unit tests cover each check where it is made (``formats``, ``transform``, ``manifest``,
the readers, the collective verdicts); one batch of concurrent 2-rank CLI jobs checks that
a bad file met by every rank alike (or by several ranks at once) ends the job with code 2
and its message exactly once on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from cosmotrain.comm.collective import together
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.synthetic.datagen import generate_dataset
from cosmotrain.data.dataset.manifest import open_manifest
from cosmotrain.data.readers.transform import check_domain
from cosmotrain.errors import DataError, UserError

TIMEOUT = 120


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny datasets (4 samples of 4 x 8^3): int16 and float32."""
    root = tmp_path_factory.mktemp("bad_input")
    made = {}
    for dtype in ("int16", "float32"):
        made[dtype] = root / dtype
        generate_dataset(made[dtype], 4, 8, 5, dtype=dtype, val_fraction=0.25)
    return made


def copy_of(template: Path, tmp_path: Path, name: str = "data") -> tuple[Path, Path]:
    """A fresh copy of a dataset (no caches) and the path of its second training file."""
    root = tmp_path / name
    shutil.copytree(template, root)
    return root, root / "train" / "sample_000001.hdf5"


def rewrite(path: Path, dataset: str, values: np.ndarray, keep_layout: bool = True) -> None:
    with h5py.File(path, "r+") as handle:
        del handle[dataset]
        handle[dataset] = values
        if not keep_layout:
            del handle.attrs[formats.LAYOUT_ATTR]


def set_values(path: Path, dataset: str, change: Any) -> None:
    with h5py.File(path, "r+") as handle:
        values = handle[dataset][()]
        change(values)
        handle[dataset][...] = values


# 1. a `full` dataset that is not 4-D

@pytest.mark.parametrize("keep_layout", [True, False])
def test_a_3d_volume_names_the_file_and_the_expected_shape(template: dict[str, Path],
                                                           tmp_path: Path,
                                                           keep_layout: bool) -> None:
    root, bad = copy_of(template["int16"], tmp_path)
    expect = formats.probe(bad)[0]
    rewrite(bad, "full", np.zeros((8, 8, 8), np.int16), keep_layout)
    readers = [lambda: formats.probe(bad), lambda: formats.read_sample(bad),
               lambda: formats.read_sample(bad, layout=formats.CHANNELS_FIRST),
               lambda: formats.read_block(bad, expect), lambda: open_manifest(root, 8)]
    for read in readers:
        with pytest.raises(DataError) as info:
            read()
        message = str(info.value)
        assert f"data file '{bad}'" in message and "(8, 8, 8) (3-D)" in message
        assert "expected 4-D [W, W, W, 4] or [4, W, W, W]" in message


def test_a_manifest_with_a_3d_volume_shape_is_rejected(template: dict[str, Path],
                                                       tmp_path: Path) -> None:
    root, _ = copy_of(template["int16"], tmp_path)
    manifest = root / "manifest.json"
    description = json.loads(manifest.read_text())
    description["volume_shape"] = [8, 8, 8]
    manifest.write_text(json.dumps(description))
    with pytest.raises(DataError, match=r"manifest.json': volume_shape: .*expected 4-D"):
        open_manifest(root, 8)


def test_volume_problem() -> None:
    assert formats.volume_problem((8, 8, 8, 4), formats.CHANNELS_LAST) is None
    assert formats.volume_problem((4, 8, 8, 8), formats.CHANNELS_FIRST) is None
    assert "expected a cube" in formats.volume_problem((8, 8, 4, 4), formats.CHANNELS_LAST)
    assert "5-D" in formats.volume_problem((1, 4, 8, 8, 8), formats.CHANNELS_FIRST)


# 5. and 7. labels: in [-1, 1] and finite; a NaN label is not a missing one

@pytest.mark.parametrize("labels, fragment", [
    ([0.0, 1.5, 0.0, 0.0], "label outside [-1, 1]: [0, 1.5, 0, 0]"),
    ([-1.01, 0.0, 0.0, 0.0], "label outside [-1, 1]"),
    ([0.0, np.nan, 0.0, 0.0], "non-finite label (NaN or Inf): [0, nan, 0, 0]"),
    ([np.inf, 0.0, 0.0, 0.0], "non-finite label"),
])
def test_bad_labels_name_the_file(template: dict[str, Path], tmp_path: Path,
                                  labels: list[float], fragment: str) -> None:
    root, bad = copy_of(template["int16"], tmp_path)
    set_values(bad, "unitPar", lambda v: v.__setitem__(slice(None), labels))
    for read in (lambda: formats.probe(bad), lambda: formats.read_sample(bad),
                 lambda: open_manifest(root, 8)):
        with pytest.raises(DataError) as info:
            read()
        message = str(info.value)
        assert f"data file '{bad}'" in message and fragment in message, message
        assert "has no 'unitPar'" not in message and "in [-1, 1]" in message


def test_labels_at_the_bounds_and_missing_labels_pass(template: dict[str, Path],
                                                      tmp_path: Path) -> None:
    root, edge = copy_of(template["int16"], tmp_path)
    set_values(edge, "unitPar", lambda v: v.__setitem__(slice(None), [-1, 1, 0, -0.5]))
    assert formats.probe(edge)[1].tolist() == [-1, 1, 0, -0.5]
    with h5py.File(root / "train" / "sample_000002.hdf5", "r+") as handle:
        del handle["unitPar"]  # unlabelled: fine for prediction, refused for training
    manifest = open_manifest(root, 8)
    with pytest.raises(DataError, match="has no 'unitPar' labels") as info:
        manifest.require_labels("train")
    assert info.value.collective  # every rank holds the same table: printed once


# 8. NaN / Inf in an input volume, and values the transform turns into NaN

@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_float_volumes_are_rejected(template: dict[str, Path], tmp_path: Path,
                                               value: float) -> None:
    _, bad = copy_of(template["float32"], tmp_path)
    expect = formats.probe(bad)[0]
    set_values(bad, "full", lambda v: v.__setitem__((1, 2, 3, 0), value))
    for read in (lambda: formats.read_block(bad, expect), lambda: formats.read_sample(bad)):
        with pytest.raises(DataError) as info:
            read()
        assert f"data file '{bad}'" in str(info.value)
        assert "1 non-finite value(s) (NaN or Inf)" in str(info.value)
    clean = (slice(4, 8), slice(0, 8), slice(0, 8))  # a block without the bad voxel reads
    assert np.isfinite(formats.read_block(bad, expect, clean)).all()


def test_check_domain_of_the_log1p_transform() -> None:
    counts = np.zeros((4, 2, 2, 2), np.int16)
    for name in ("log1p", "mean", "none"):
        check_domain("ok.hdf5", counts, name)
    counts[0, 1, 1, 1] = -1
    check_domain("ok.hdf5", counts, "none")
    with pytest.raises(DataError, match=r"data file 'x.hdf5': 'full' holds the value -1, "
                                        r"which the log1p transform"):
        check_domain("x.hdf5", counts, "log1p")


@pytest.mark.parametrize("reader", ["preload", "direct"])
def test_the_readers_refuse_bad_volumes(template: dict[str, Path], tmp_path: Path,
                                        reader: str) -> None:
    """End to end in one process: the readers' own reads meet the damage."""
    from cosmotrain.config.load import load_config
    from cosmotrain.data.readers.placement import BlockPlacement
    from cosmotrain.data.readers.job_readers import make_readers, open_dataset

    for dtype, change, fragment in [
            ("float32", lambda v: v.__setitem__((0, 0, 0, 1), np.nan), "non-finite"),
            ("int16", lambda v: v.__setitem__((0, 0, 0, 1), -7), "value -7")]:
        root, bad = copy_of(template[dtype], tmp_path, f"{reader}-{dtype}")
        cfg = load_config(None, ["model.width=8", "train.batch_size=3", f"data.path={root}",
                                 f"data.reader={reader}", "data.prefetch=false"])
        manifest = open_dataset(cfg, None)
        set_values(bad, "full", change)
        placement = BlockPlacement((1, 1, 1, 1, 1), (0, 0, 0, 0, 0), 4, 8)
        from mpi4py import MPI

        with pytest.raises(DataError) as info:
            readers = make_readers(cfg, manifest, MPI.COMM_SELF, placement, ["train"])
            for _ in readers["train"].epoch(0):
                pass
        assert f"data file '{bad}'" in str(info.value) and fragment in str(info.value)
        assert info.value.collective


# 9. one verdict on every rank

class FakeComm:
    """Rank ``rank`` of ``size``: collectives return ``others`` with mine at my rank."""

    def __init__(self, rank: int, others: list[Any]) -> None:
        self.rank, self.others = rank, others

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return len(self.others) + 1

    def allgather(self, mine: Any) -> list[Any]:
        return self.others[:self.rank] + [mine] + self.others[self.rank:]

    def allreduce(self, mine: int) -> int:
        return mine + sum(int(x is not None) for x in self.others)


def test_together_raises_the_lowest_failing_ranks_error_on_every_rank() -> None:
    def fail() -> None:
        raise DataError("b.hdf5", "broken")

    with pytest.raises(DataError, match="b.hdf5") as info:
        together(FakeComm(0, [None]), fail)
    assert info.value.collective
    with pytest.raises(DataError, match="'a.hdf5': other") as info:  # rank 0 failed too
        together(FakeComm(1, [("DataError", "data file 'a.hdf5': other")]), fail)
    assert info.value.collective and type(info.value) is DataError
    with pytest.raises(UserError, match="a.hdf5"):  # I succeeded, another rank did not
        together(FakeComm(1, [("DataError", "data file 'a.hdf5': other")]), lambda: 1)
    assert together(FakeComm(0, [None]), lambda: 7) == 7


def test_the_label_pass_reports_the_first_bad_file_in_dataset_order() -> None:
    from cosmotrain.data.dataset.sample_table import _collective_pass

    def work(split: str, i: int) -> int:
        if i in (3, 4):
            raise DataError(f"f{i}", "bad")
        return i

    # rank 1 of 2 does items 1, 3, 5 and fails at 3; rank 0 (items 0, 2, 4) failed at 4
    rank0 = ([("train", 0, 0), ("train", 2, 2)], (4, "DataError", "data file 'f4': bad"))
    with pytest.raises(DataError, match="'f3': bad") as info:
        _collective_pass({"train": range(6)}, FakeComm(1, [rank0]), work)
    assert info.value.collective
    assert _collective_pass({"train": [0, 2]}, FakeComm(0, []), lambda s, i: i)["train"] \
        == {0: 0, 2: 2}


# the CLI under 2 ranks: exit 2, the message exactly once, no traceback

def test_bad_files_print_once_under_two_ranks(template: dict[str, Path],
                                              tmp_path: Path) -> None:
    from conftest import stderr_of, REPO, mpiexec, subprocess_env

    def unseen(root: Path, bad: Path, damage: Callable[[], None]) -> Path:
        """The label table cached, then ``bad`` damaged behind its back (size and mtime
        kept, as by bit rot): the label pass trusts the cache, the readers meet it."""
        open_manifest(root, 8)
        before = bad.stat()
        damage()
        os.utime(bad, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert bad.stat().st_size == before.st_size
        return root

    cases = []  # (name, dataset root, overrides, expected message fragment)
    root, bad = copy_of(template["int16"], tmp_path, "label")
    set_values(bad, "unitPar", lambda v: v.__setitem__(0, np.nan))
    cases.append(("NaN label, label pass", root, [], f"data file '{bad}': 'unitPar' holds "
                  "a non-finite label"))
    root, bad = copy_of(template["int16"], tmp_path, "shape")
    root = unseen(root, bad, lambda: rewrite(bad, "full", np.zeros((8, 8, 8), np.int16)))
    cases.append(("3-D volume, preload read by both ranks", root,
                  ["parallel.depth=2", "data.verify=never"],  # the reader meets it
                  f"data file '{bad}': 'full' has shape (8, 8, 8)"))
    root, bad = copy_of(template["float32"], tmp_path, "nan")
    root = unseen(root, bad, lambda: set_values(
        bad, "full", lambda v: v.__setitem__(slice(None), np.nan)))
    cases.append(("NaN volume, direct read by both ranks", root,
                  ["parallel.depth=2", "data.reader=direct", "data.verify=never"],
                  f"data file '{bad}': 'full' holds"))
    root, bad = copy_of(template["int16"], tmp_path, "rot")
    root = unseen(root, bad, lambda: set_values(
        bad, "full", lambda v: v.__setitem__((0, 0, 0, 1), 5)))
    cases.append(("bit rot, data.verify: auto on both ranks", root, ["parallel.depth=2"],
                  f"data file '{bad}': does not match its CRC-32C in manifest.json"))
    root, bad = copy_of(template["int16"], tmp_path, "unlabelled")
    with h5py.File(bad, "r+") as handle:
        del handle["unitPar"]
    cases.append(("missing labels", root, ["data.verify=never"],  # checked after the sums
                  f"data file '{bad}': has no 'unitPar' labels"))

    jobs = []
    for i, (name, root, overrides, _) in enumerate(cases):
        sets = ["model.width=8", "data.source=files", f"data.path={root}",
                f"output.dir={tmp_path / f'run{i}'}", "train.batch_size=2",
                "train.max_steps=2", *overrides]
        cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain", "train",
               "--config", str(REPO / "configs" / "tiny.yaml")]
        cmd += [arg for item in sets for arg in ("--set", item)]
        jobs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=subprocess_env()))
    for (name, _, _, fragment), job in zip(cases, jobs):
        err = stderr_of(job, name, TIMEOUT)
        assert job.returncode == 2, f"{name}: exit {job.returncode}\n{err}"
        assert err.count("cosmotrain: error:") == 1, f"{name}: {err}"
        assert err.count(fragment) == 1, f"{name}: {err}"
        assert "Traceback" not in err, f"{name}: {err}"
