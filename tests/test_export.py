"""``cosmotrain export``: a checkpoint's weights as .safetensors (no torch) or .pt.

A short run of each model is trained in-process (``cosmoflow`` at width 16 and ``tiny``,
both with batch norm so the running statistics and ``num_batches_tracked`` are exported),
then exported.  The .safetensors file must hold exactly the checkpoint's arrays under their
PyTorch names, with the metadata to rebuild the network; loaded into the stock-``torch.nn``
twin of that network with ``strict=True``, it must predict what cosmotrain predicts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from mpi4py import MPI

from conftest import latest_checkpoint
from cosmotrain.config.load import config_from_mapping, load_config
from cosmotrain.config.schema import ModelConfig
from cosmotrain.data.formats import interface as formats
from cosmotrain.data.readers.transform import apply_transform
from cosmotrain.errors import DataError, UserError
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.train import run as runner
from cosmotrain.train.checkpoints.checkpoint import load_checkpoint
from cosmotrain.train.export import META_KEYS, export_checkpoint, exported_weights

safetensors_numpy = pytest.importorskip("safetensors.numpy")

REPO_TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
MODELS = {"tiny": 8, "cosmoflow": 16}
STEPS = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished short run of each model (batch norm on), by model name."""
    found = {}
    for name, width in MODELS.items():
        out = tmp_path_factory.mktemp(name)
        cfg = load_config(REPO_TINY, [
            f"model.name={name}", f"model.width={width}", "model.batchnorm=true",
            "data.source=synthetic", "data.synthetic.samples=8",
            "data.synthetic.val_fraction=0.25", "train.batch_size=2",
            f"train.max_steps={STEPS}", f"output.dir={out}"])
        runner.run_training(cfg, MPI.COMM_WORLD)
        found[name] = out
    return found


def checkpoint_of(run: Path) -> Path:
    found = latest_checkpoint(run / "checkpoints")
    assert found is not None
    return found


def one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert err.startswith("cosmotrain: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("name", list(MODELS))
def test_safetensors_holds_the_checkpoint_arrays_under_pytorch_names(
        runs: dict[str, Path], tmp_path: Path, cli, name: str) -> None:
    out = tmp_path / "model.safetensors"
    code, stdout, err = cli("export", "--checkpoint", str(checkpoint_of(runs[name])),
                            "--out", str(out))
    assert code == 0, err
    assert f"of step {STEPS} to {out} (safetensors" in stdout
    state = load_checkpoint(checkpoint_of(runs[name]))
    tensors = safetensors_numpy.load_file(out)
    model = build_model(config_from_mapping(yaml.safe_load(state.config_yaml)).model, seed=0)
    names = [n for n, _ in model.named_parameters()] + [n for n, _, _ in model.named_buffers()]
    assert sorted(tensors) == sorted(names) == sorted([*state.params, *state.buffers])
    for key, value in [*state.params.items(), *state.buffers.items()]:
        assert tensors[key].dtype == np.asarray(value).dtype, key
        np.testing.assert_array_equal(tensors[key], value, err_msg=key)
    assert {tensors[n].dtype for n in state.params} == {np.dtype(np.float32)}
    tracked = [n for n in tensors if n.endswith("num_batches_tracked")]
    assert tracked and all(tensors[n].shape == () and tensors[n].dtype == np.int64
                           and tensors[n] == STEPS for n in tracked)
    assert tensors["conv1.weight"].shape == (model.items[0].out_channels, 4, 3, 3, 3)


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return f.metadata()


def test_the_header_says_how_to_rebuild_and_feed_the_network(
        runs: dict[str, Path], tmp_path: Path) -> None:
    checkpoint = checkpoint_of(runs["cosmoflow"])
    out = tmp_path / "model.safetensors"
    summary = export_checkpoint(checkpoint, out)
    meta = read_metadata(out)
    assert sorted(meta) == sorted(META_KEYS)
    state = load_checkpoint(checkpoint)
    cfg = config_from_mapping(yaml.safe_load(state.config_yaml))
    assert meta["format"] == "pt" and meta["cosmotrain.format"] == "cosmotrain-export"
    assert meta["cosmotrain.model"] == "cosmoflow"
    assert ModelConfig(**json.loads(meta["cosmotrain.model_config"])) == cfg.model
    assert json.loads(meta["cosmotrain.input_shape"]) == [4, 16, 16, 16]
    assert meta["cosmotrain.transform"] == cfg.data.transform
    assert meta["cosmotrain.config"] == state.config_yaml
    assert int(meta["cosmotrain.step"]) == state.step == summary.step == STEPS
    import cosmotrain

    assert meta["cosmotrain.version"] == cosmotrain.__version__
    assert summary.parameters == sum(v.size for v in state.params.values())
    assert summary.size == out.stat().st_size


def samples_of(run: Path, transform: str) -> np.ndarray:
    files = sorted((run / "data").rglob("*.hdf5"))[:3]
    return np.concatenate([apply_transform(formats.read_sample(p)[0][None], transform)
                           for p in files])


def cosmotrain_forward(checkpoint: Path, x: np.ndarray) -> np.ndarray:
    """The serial cosmotrain model with the checkpoint's arrays, in evaluation mode."""
    state = load_checkpoint(checkpoint)
    model = build_model(config_from_mapping(yaml.safe_load(state.config_yaml)).model, seed=7)
    for key, param in model.named_parameters():
        param.data[...] = state.params[key]
    for key, layer, slot in model.named_buffers():
        layer.buffers[slot] = np.asarray(state.buffers[key]).astype(
            np.asarray(layer.buffers[slot]).dtype)
    return np.asarray(model.forward(x.copy(), Context(training=False, seed=0)))


def twin_from_export(tensors: dict, meta: dict[str, str]):
    """The torch twin built from the header's model config alone, loaded strictly."""
    from torch_mirror import mirror

    model = build_model(ModelConfig(**json.loads(meta["cosmotrain.model_config"])), seed=99)
    twin = mirror(model)
    twin.load_state_dict(tensors, strict=True)
    return twin.eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_the_torch_twin_loads_the_export_strictly_and_predicts_alike(
        runs: dict[str, Path], tmp_path: Path, cli, name: str) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    checkpoint = checkpoint_of(runs[name])
    exported = {}
    for suffix in (".safetensors", ".pt"):
        out = tmp_path / f"model{suffix}"
        code, _, err = cli("export", "--checkpoint", str(checkpoint), "--out", str(out))
        assert code == 0, err
        exported[suffix] = out
    from_safetensors = load_file(exported[".safetensors"])
    from_pt = torch.load(exported[".pt"], weights_only=True)
    assert list(from_pt) == list(exported_weights(load_checkpoint(checkpoint)).tensors)
    assert sorted(from_pt) == sorted(from_safetensors)
    for key, value in from_pt.items():
        assert value.dtype == from_safetensors[key].dtype and torch.equal(
            value, from_safetensors[key]), key

    meta = read_metadata(exported[".safetensors"])
    x = samples_of(runs[name], meta["cosmotrain.transform"])
    expected = cosmotrain_forward(checkpoint, x)
    assert x.shape[1:] == tuple(json.loads(meta["cosmotrain.input_shape"]))
    with torch.no_grad():
        for tensors in (from_safetensors, from_pt):
            found = twin_from_export(tensors, meta)(torch.from_numpy(x)).numpy()
            scale = np.abs(expected).max()
            np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-5 * scale)


def test_safetensors_needs_no_torch_and_pt_says_so(
        runs: dict[str, Path], tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    checkpoint = str(checkpoint_of(runs["tiny"]))
    code, _, err = cli("export", "--checkpoint", checkpoint, "--out",
                       str(tmp_path / "m.safetensors"))
    assert code == 0, err
    assert sorted(safetensors_numpy.load_file(tmp_path / "m.safetensors"))
    code, _, err = cli("export", "--checkpoint", checkpoint, "--out", str(tmp_path / "m.pt"))
    assert "torch is needed" in one_line_error(code, err) and ".safetensors" in err
    assert not (tmp_path / "m.pt").exists()


def test_without_safetensors_the_extra_is_named(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(UserError, match=r'pip install -e "\.\[export\]"'):
        export_checkpoint(checkpoint_of(runs["tiny"]), tmp_path / "m.safetensors")


def damaged_copy(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy with one weight changed behind its checksum's back."""
    copy = tmp_path / checkpoint.name
    copy.write_bytes(checkpoint.read_bytes())
    with h5py.File(copy, "r+") as f:
        f["params/fc1.weight"][0, 0] += 1.0
    return copy


@pytest.mark.parametrize("case", ["missing", "damaged", "suffix", "directory"])
def test_bad_inputs_are_one_line_errors(runs: dict[str, Path], tmp_path: Path, cli,
                                        case: str) -> None:
    checkpoint, out = checkpoint_of(runs["tiny"]), tmp_path / "model.safetensors"
    expected = {"missing": "': not found", "damaged": "fails its checksum",
                "suffix": "unknown suffix", "directory": "is a directory"}[case]
    if case == "missing":
        checkpoint = tmp_path / "nope.h5"
    elif case == "damaged":
        checkpoint = damaged_copy(checkpoint, tmp_path)
    elif case == "suffix":
        out = tmp_path / "model.npz"
    else:
        out.mkdir()
    code, _, err = cli("export", "--checkpoint", str(checkpoint), "--out", str(out))
    assert expected in one_line_error(code, err)
    if case == "suffix":
        assert ".safetensors" in err and ".pt" in err
    if case == "missing":  # named as what it is, not as a data file
        assert f"checkpoint '{checkpoint}': not found" in err
    left = {"damaged": [checkpoint.name], "directory": [out.name]}.get(case, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == left  # nothing written


def test_an_existing_out_is_replaced_only_with_overwrite(runs: dict[str, Path],
                                                         tmp_path: Path, cli) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"keep me")
    checkpoint = str(checkpoint_of(runs["tiny"]))
    code, _, err = cli("export", "--checkpoint", checkpoint, "--out", str(out))
    assert "already exists; pass --overwrite" in one_line_error(code, err)
    assert out.read_bytes() == b"keep me"
    code, _, err = cli("export", "--checkpoint", checkpoint, "--out", str(out), "--overwrite")
    assert code == 0, err
    assert "fc1.weight" in safetensors_numpy.load_file(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no .tmp


def test_a_checkpoint_that_does_not_match_its_network_is_refused(
        runs: dict[str, Path]) -> None:
    state = load_checkpoint(checkpoint_of(runs["tiny"]))
    del state.params["fc2.bias"]
    state.buffers["bn1.extra"] = np.zeros(3, np.float32)
    state.params["fc1.weight"] = state.params["fc1.weight"][:, :4]
    with pytest.raises(DataError, match=r"missing: fc2\.bias; not in the network: bn1\.extra;"
                                        r" shape: fc1\.weight \(16, 4\)"):
        exported_weights(state, "ckpt.h5")


def test_export_refuses_to_run_on_several_ranks(runs: dict[str, Path], tmp_path: Path, cli,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import cosmotrain.comm

    class TwoRanks:
        def Get_size(self) -> int:
            return 2

        def Get_rank(self) -> int:
            return 0

    monkeypatch.setattr(cosmotrain.comm, "world", lambda: TwoRanks())
    code, _, err = cli("export", "--checkpoint", str(checkpoint_of(runs["tiny"])), "--out",
                       str(tmp_path / "m.safetensors"))
    assert "runs on one process" in one_line_error(code, err)
