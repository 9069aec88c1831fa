"""``cosmotrain export``: a checkpoint's weights as a PyTorch ``state_dict`` file.

Checkpoints already hold every parameter and buffer under its PyTorch ``state_dict`` name
and in PyTorch's layout (``tests/torch_mirror.py`` proves it by loading them into stock
``torch.nn`` modules with ``strict=True``), so exporting is a change of container, not of
content: the arrays are written unchanged, batch-norm ``num_batches_tracked`` included as
the 0-d int64 that ``BatchNorm3d`` expects.

- ``.safetensors`` is written through safetensors' *numpy* API, so it needs no torch.  Its
  header carries what a reader needs to rebuild the network and feed it (:data:`META_KEYS`):
  the model name and section, the input transform and shape, the whole resolved config, the
  cosmotrain version and the checkpoint's step.
- ``.pt`` is ``torch.save`` of a plain ``state_dict`` (loads with ``weights_only=True``);
  it needs torch and carries no metadata.

The checkpoint is loaded with its checksums verified (a damaged one is refused as ``predict``
refuses it), and its arrays are checked against the network its own config describes: the
same names and shapes, nothing missing, nothing extra, so ``load_state_dict(strict=True)``
of the rebuilt network succeeds.  The file is built in memory and written atomically;
an existing ``--out`` is replaced only when asked.
"""

from __future__ import annotations

import importlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cosmotrain import __version__
from cosmotrain.files.previous import refuse_existing_file
from cosmotrain.files.atomic import check_writable, write_bytes_atomically
from cosmotrain.config.load import build
from cosmotrain.config.schema import ModelConfig
from cosmotrain.errors import DataError, UserError
from cosmotrain.models import build_model
from cosmotrain.train.checkpoints.checkpoint import CheckpointState, load_checkpoint

FORMAT = "cosmotrain-export"
FORMAT_VERSION = 1
EXTRA = "export"
SUFFIXES = {".safetensors": "safetensors", ".pt": "pt"}
#: The safetensors header: ``format: pt`` (the convention PyTorch loaders look for) and the
#: cosmotrain keys, every value a string as safetensors requires (JSON where structured).
META_KEYS = ("format", "cosmotrain.format", "cosmotrain.format_version", "cosmotrain.version",
             "cosmotrain.model", "cosmotrain.model_config", "cosmotrain.input_shape",
             "cosmotrain.transform", "cosmotrain.step", "cosmotrain.epoch",
             "cosmotrain.config")


@dataclass
class ExportedWeights:
    """The arrays to write, by PyTorch name (parameters, then buffers), and the header."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]


@dataclass
class ExportSummary:
    """What :func:`export_checkpoint` wrote, for the command's one line."""

    out: Path
    kind: str
    tensors: int
    parameters: int
    step: int
    size: int

    def describe(self) -> str:
        return (f"exported {self.tensors} tensor(s) ({self.parameters:,} parameters) of step "
                f"{self.step} to {self.out} ({self.kind}, {self.size:,} bytes)")


def export_checkpoint(checkpoint: Path, out: Path, overwrite: bool = False) -> ExportSummary:
    """Write the weights of ``checkpoint`` to ``out`` (.safetensors or .pt), atomically.

    Everything that can be refused without reading the checkpoint is refused first: an
    ``out`` that is a directory or exists (unless ``overwrite``), the suffix, the package
    the format needs and a directory that cannot be written.  Bad input is a one-line
    UserError / DataError.
    """
    out = Path(out)
    check_export_out(out, overwrite)
    kind = export_kind(out)
    serialize = serializer(kind)
    check_writable(out.parent, where="--out")
    state = load_checkpoint(checkpoint)
    weights = exported_weights(state, checkpoint)
    data = serialize(weights)
    write_bytes_atomically(out, data, where="--out")
    parameters = sum(int(np.size(value)) for value in state.params.values())
    return ExportSummary(out, kind, len(weights.tensors), parameters, state.step, len(data))


def export_kind(out: Path) -> str:
    """``safetensors`` or ``pt`` from the suffix of ``out``; anything else is a UserError."""
    kind = SUFFIXES.get(Path(out).suffix.lower())
    if kind is None:
        raise UserError(f"--out '{out}' has an unknown suffix; name a .safetensors file "
                        f"(no torch needed) or a .pt file (a torch state_dict)")
    return kind


def check_export_out(out: Path, overwrite: bool) -> None:
    """Refuse a directory, and an existing file unless ``overwrite``."""
    refuse_existing_file(out, overwrite, f"a file such as {out / 'model.safetensors'}")


def serializer(kind: str) -> Callable[[ExportedWeights], bytes]:
    """The function that turns weights into the file's bytes; imports its package now, so
    a missing one is refused before the checkpoint is read."""
    if kind == "safetensors":
        try:
            importlib.import_module("safetensors.numpy")
        except ImportError:
            raise UserError(f"writing .safetensors needs the safetensors package; install "
                            f'it with pip install -e ".[{EXTRA}]"') from None
        return safetensors_bytes
    try:
        importlib.import_module("torch")
    except ImportError:
        raise UserError("torch is needed to write .pt files and is not installed; export to "
                        ".safetensors instead, which works without torch") from None
    return torch_bytes


def safetensors_bytes(weights: ExportedWeights) -> bytes:
    """The .safetensors file: the arrays and the metadata header (numpy API, no torch)."""
    from safetensors.numpy import save

    return save(weights.tensors, metadata=weights.metadata)


def torch_bytes(weights: ExportedWeights) -> bytes:
    """The .pt file: ``torch.save`` of the ``state_dict`` (an OrderedDict of tensors)."""
    from collections import OrderedDict

    import torch

    state = OrderedDict((name, torch.from_numpy(np.array(array)))
                        for name, array in weights.tensors.items())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def exported_weights(state: CheckpointState, source: Path | str = "checkpoint"
                     ) -> ExportedWeights:
    """The arrays of ``state`` by PyTorch name, checked against the network its config
    describes, with the metadata to rebuild that network (a mismatch is a DataError)."""
    raw = yaml.safe_load(state.config_yaml) or {}
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise DataError(source, "its config has no model section",
                        "export a checkpoint written by cosmotrain train", kind="checkpoint")
    model_cfg = build(ModelConfig, raw["model"], prefix="model.")
    # np.asarray, not np.ascontiguousarray: that one makes num_batches_tracked 1-d
    tensors = {name: np.asarray(value, order="C")
               for name, value in [*state.params.items(), *state.buffers.items()]}
    check_against_model(tensors, expected_shapes(model_cfg), source)
    return ExportedWeights(tensors, export_metadata(state, raw, model_cfg))


def expected_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` names and shapes of the network ``model_cfg`` describes."""
    model = build_model(model_cfg, seed=0)
    shapes = {name: tuple(p.data.shape) for name, p in model.named_parameters()}
    shapes.update({name: tuple(np.shape(layer.buffers[key]))
                   for name, layer, key in model.named_buffers()})
    return shapes


def check_against_model(tensors: dict[str, np.ndarray],
                        expected: dict[str, tuple[int, ...]], source: Path | str) -> None:
    """The checkpoint must hold exactly the network's entries, each in its shape."""
    missing = [name for name in expected if name not in tensors]
    extra = [name for name in tensors if name not in expected]
    wrong = [f"{name} {tuple(tensors[name].shape)} (the network has {shape})"
             for name, shape in expected.items()
             if name in tensors and tuple(tensors[name].shape) != shape]
    problems = [f"{label}: {', '.join(items[:5])}" for label, items in
                (("missing", missing), ("not in the network", extra), ("shape", wrong))
                if items]
    if problems:
        raise DataError(source, f"does not match the network its config describes ("
                        f"{'; '.join(problems)})",
                        "export a checkpoint written by this version of cosmotrain")


def export_metadata(state: CheckpointState, raw: dict[str, Any], model_cfg: ModelConfig
                    ) -> dict[str, str]:
    """The safetensors header (see :data:`META_KEYS`)."""
    width = model_cfg.width
    transform = (raw.get("data") or {}).get("transform", "log1p")
    meta = {"format": "pt", "cosmotrain.format": FORMAT,
            "cosmotrain.format_version": str(FORMAT_VERSION),
            "cosmotrain.version": __version__, "cosmotrain.model": model_cfg.name,
            "cosmotrain.model_config": json.dumps(asdict(model_cfg)),
            "cosmotrain.input_shape": json.dumps([model_cfg.channels, width, width, width]),
            "cosmotrain.transform": str(transform), "cosmotrain.step": str(state.step),
            "cosmotrain.epoch": str(state.epoch), "cosmotrain.config": state.config_yaml}
    return meta
