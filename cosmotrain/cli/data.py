"""Commands that make and move datasets: datagen, preload."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.cli.app import ConfigOption, SetOption, app


class Layout(str, Enum):
    channels_last = "channels-last"
    channels_first = "channels-first"


class DType(str, Enum):
    int16 = "int16"
    float32 = "float32"


class Shuffle(str, Enum):
    global_ = "global"
    local = "local"


@app.command()
def datagen(
    out: Annotated[Path, typer.Option(help="Output directory of the dataset.")],
    samples: Annotated[int, typer.Option(help="Number of samples (train + validation).")] = 64,
    width: Annotated[int, typer.Option(help="Cube width W: samples are 4 x W^3.")] = 64,
    seed: Annotated[int, typer.Option(help="Seed: same seed, same data, at any rank count.")] = 1,
    layout: Annotated[Layout, typer.Option(
        help="channels-last [W,W,W,4] (original) or channels-first [4,W,W,W] (LBANN).")]
    = Layout.channels_last,
    dtype: Annotated[DType, typer.Option(help="int16 particle counts or float32.")]
    = DType.int16,
    val_fraction: Annotated[float, typer.Option(
        help="Fraction of the samples held out for validation.")] = 0.125,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing dataset in --out.")]
    = False,
) -> None:
    """Write a synthetic CosmoFlow dataset (HDF5, one file per sample) with learnable labels."""
    from cosmotrain.comm import world
    from cosmotrain.console import progress
    from cosmotrain.data.datagen import generate_dataset

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = len(range(rank, samples, size))
    with progress(mine, f"datagen (rank 0 of {size})", rank) as update:
        manifest = generate_dataset(out, samples, width, seed, layout=layout.value,
                                    dtype=dtype.value, val_fraction=val_fraction,
                                    overwrite=overwrite, comm=comm, progress=update)
    if rank == 0:
        counts = ", ".join(f"{split}: {manifest['splits'][split]['count']}"
                           for split in manifest["splits"])
        print(f"wrote {samples} samples of 4 x {width}^3 ({counts}) to {out}")


@app.command()
def preload(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    dest: Annotated[Optional[Path], typer.Option(
        help="Node-local directory to stage into (default: data.stage_dir, else "
             "$TMPDIR/cosmotrain/<dataset name>).")] = None,
    shuffle: Annotated[Optional[Shuffle], typer.Option(
        help="global: every node copies the whole dataset; local: each node only the "
             "shards of its sample groups (default: data.shuffle).")] = None,
) -> None:
    """Stage the config's dataset onto each node's local storage (copy, verify, manifest)."""
    from cosmotrain.comm import world
    from cosmotrain.config import load_config
    from cosmotrain.console import progress
    from cosmotrain.data.staging import plan_staging, run_staging

    extra = [f"data.shuffle={shuffle.value}"] if shuffle is not None else []
    cfg = load_config(config_file, [*(overrides or []), *extra])
    comm = world()
    plan = plan_staging(cfg, comm, dest)
    with progress(len(plan.mine), f"preload (rank 0 of {comm.Get_size()})",
                  comm.Get_rank()) as update:
        report = run_staging(plan, comm, update)
    if comm.Get_rank() == 0:
        print(report.describe())


