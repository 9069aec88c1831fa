"""Commands that move weights out of cosmotrain: export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cosmotrain.cli.app import app
from cosmotrain.errors import UserError


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Option(
        help="A checkpoint written by cosmotrain train (output.dir/checkpoints/*.h5).")],
    out: Annotated[Path, typer.Option(
        help="File to write: .safetensors (PyTorch names and layouts, with the model's "
             "config in its header; no torch needed) or .pt (a torch state_dict).")],
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace --out when it exists.")] = False,
) -> None:
    """Write a checkpoint's weights for PyTorch (load_state_dict(strict=True) loads them)."""
    from cosmotrain.comm import world
    from cosmotrain.train.export import export_checkpoint

    if world().Get_size() > 1:
        raise UserError("cosmotrain export runs on one process: run it without mpiexec "
                        "or srun")
    print(export_checkpoint(checkpoint, out, overwrite).describe())
