"""Spatial hyperslab reads of CosmoFlow sample files (``read_sample`` with a box), and errors."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmotrain.data.formats.interface import LAYOUTS, read_sample, write_sample
from cosmotrain.errors import DataError
from cosmotrain.tensor.distribution import Distribution


def sample(width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    volume = rng.integers(0, 300, size=(4, width, width, width)).astype(np.float32)
    return volume, rng.uniform(-1, 1, 4).astype(np.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_every_block_is_exactly_that_part_of_the_volume(tmp_path: Path, layout: str,
                                                        dtype: str) -> None:
    volume, labels = sample(9)
    path = tmp_path / "s.hdf5"
    write_sample(path, volume, labels, layout=layout, dtype=dtype)
    dist = Distribution((4, 9, 9, 9), (1, 2, 3, 2))  # uneven blocks
    for coord in dist.coords():
        box = dist.block(coord)[1:]
        block, got_labels = read_sample(path, box=box)
        np.testing.assert_array_equal(block, volume[(slice(None),) + box])
        assert block.dtype == np.float32 and block.flags.c_contiguous
        np.testing.assert_array_equal(got_labels, labels)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sub_cube_of_a_universe(tmp_path: Path, layout: str) -> None:
    """A model-width cube at ``origin`` inside a larger universe, read block by block."""
    universe, labels = sample(12, seed=1)
    path = tmp_path / "universe.hdf5"
    write_sample(path, universe, labels, layout=layout, dtype="float32")
    origin = (4, 0, 8)
    box = (slice(1, 3), slice(0, 4), slice(2, 4))  # inside the 4^3 cube at origin
    block, _ = read_sample(path, box=box, origin=origin)
    np.testing.assert_array_equal(block, universe[:, 5:7, 0:4, 10:12])


def test_layout_is_inferred_without_the_attribute(tmp_path: Path) -> None:
    volume, labels = sample(5)
    path = tmp_path / "foreign.hdf5"
    with h5py.File(path, "w") as handle:  # the original CosmoFlow files: no layout attr
        handle["full"] = np.moveaxis(volume, 0, -1).astype(np.int16)
        handle["unitPar"] = labels
    block, _ = read_sample(path, box=(slice(0, 5), slice(1, 2), slice(0, 5)))
    np.testing.assert_array_equal(block, volume[:, :, 1:2, :])


def broken_files(tmp_path: Path) -> dict[str, Path]:
    volume, labels = sample(6)
    good = tmp_path / "good.hdf5"
    write_sample(good, volume, labels)
    files = {}
    truncated = tmp_path / "truncated.hdf5"
    truncated.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    files["truncated"] = truncated
    garbage = tmp_path / "garbage.hdf5"
    garbage.write_bytes(b"not an HDF5 file at all" * 10)
    files["corrupt"] = garbage
    for name, content in {"missing key": {"unitPar": labels},  # no volume (labels are
                          # optional: a file without them is unlabelled data)
                          "wrong shape": {"full": np.zeros((6, 6, 6), np.int16),
                                          "unitPar": labels},
                          "wrong dtype": {"full": np.zeros((6, 6, 6, 4), np.int64),
                                          "unitPar": labels},
                          "wrong labels": {"full": np.zeros((6, 6, 6, 4), np.int16),
                                           "unitPar": np.zeros(3, np.float32)}}.items():
        path = tmp_path / f"{name.replace(' ', '_')}.hdf5"
        with h5py.File(path, "w") as handle:
            for key, data in content.items():
                handle[key] = data
        files[name] = path
    files["block outside"] = good
    return files


def test_broken_files_raise_data_errors_naming_the_file(tmp_path: Path) -> None:
    for problem, path in broken_files(tmp_path).items():
        box = (slice(0, 3), slice(0, 3), slice(0, 9 if problem == "block outside" else 3))
        with pytest.raises(DataError) as err:
            read_sample(path, box=box)
        assert str(path) in str(err.value), problem
