"""Commands that make and move datasets: datagen, convert, preload."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.cli.app import (ConfigOption, SetOption, app, load_user_config, user_cache_dir,
                                with_user_defaults)


class Layout(str, Enum):
    channels_last = "channels-last"
    channels_first = "channels-first"


class DType(str, Enum):
    int16 = "int16"
    float32 = "float32"


class Format(str, Enum):
    hdf5 = "hdf5"
    tfrecord = "tfrecord"
    npy = "npy"


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
    format: Annotated[Format, typer.Option(
        help="hdf5 (cosmotrain's), tfrecord (MLPerf HPC) or npy (NVIDIA's *_data.npy / "
             "*_label.npy with files_data.lst).")] = Format.hdf5,
    gzip: Annotated[bool, typer.Option(
        "--gzip", help="tfrecord: compress each file as a whole (MLPerf v1.0).")] = False,
) -> None:
    """Write a synthetic CosmoFlow dataset (one file per sample) with learnable labels."""
    from cosmotrain.comm import world
    from cosmotrain.console import progress
    from cosmotrain.data.synthetic.datagen import generate_dataset

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = len(range(rank, samples, size))
    with progress(mine, f"datagen (rank 0 of {size})", rank) as update:
        manifest = generate_dataset(out, samples, width, seed, layout=layout.value,
                                    dtype=dtype.value, val_fraction=val_fraction,
                                    overwrite=overwrite, comm=comm, progress=update,
                                    format=format.value, gzip=gzip)
    if rank == 0:
        counts = ", ".join(f"{split}: {manifest['splits'][split]['count']}"
                           for split in manifest["splits"])
        kind = f"{format.value}{' (gzip)' if gzip else ''}"
        print(f"wrote {samples} {kind} samples of 4 x {width}^3 ({counts}) to {out}")


@app.command()
def convert(
    data: Annotated[Path, typer.Option(help="Source dataset directory (any format).")],
    out: Annotated[Path, typer.Option(help="Directory of the converted dataset.")],
    format: Annotated[Format, typer.Option(help="Format to write.")],
    gzip: Annotated[bool, typer.Option(
        "--gzip", help="tfrecord: compress each file as a whole (MLPerf v1.0).")] = False,
    source_format: Annotated[Optional[Format], typer.Option(
        help="Format of the source when its directory holds two (default: from the files).")]
    = None,
    overwrite: Annotated[bool, typer.Option(
        help="Start over: move what --out holds to <out>.previous-<time> (never "
             "deleted), then convert.")] = False,
) -> None:
    """Rewrite a dataset in another format (hdf5, tfrecord, npy), each file verified."""
    from cosmotrain.comm import world
    from cosmotrain.console import progress
    from cosmotrain.data.copies.convert import plan_conversion, run_conversion

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = plan_conversion(data, out, format.value, comm, gzip=gzip, overwrite=overwrite,
                           source_format=source_format.value if source_format else "auto",
                           cache_dir=user_cache_dir())
    if plan.moved_aside is not None and rank == 0:
        print(f"moved what {plan.out} held to {plan.moved_aside}")
    with progress(len(plan.mine), f"convert (rank 0 of {size})", rank) as update:
        report = run_conversion(plan, comm, update)
    if rank == 0:
        print(report.describe())


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
    overwrite: Annotated[bool, typer.Option(
        help="Start over: move what --dest holds to <dest>.previous-<time> (never "
             "deleted), then stage.")] = False,
) -> None:
    """Stage the config's dataset onto each node's local storage (copy, verify, manifest)."""
    from cosmotrain.comm import world
    from cosmotrain.console import progress
    from cosmotrain.data.copies.stage import plan_staging, run_staging
    from cosmotrain.train.outputs.mlperf_writer import staging_logged

    from cosmotrain.train.stops import STAGING, StopSignals

    extra = [f"data.shuffle={shuffle.value}"] if shuffle is not None else []
    cfg = with_user_defaults(load_user_config(config_file, [*(overrides or []), *extra]))
    comm = world()
    with StopSignals(at_once=True, during=STAGING), staging_logged(cfg, comm):  # output.mlperf_log: staging_start/stop in mlperf.log
        plan = plan_staging(cfg, comm, dest, overwrite)
        if plan.moved_aside is not None and comm.Get_rank() == 0:
            print(f"moved what {plan.dest} held to {plan.moved_aside}")
        with progress(len(plan.mine), f"preload (rank 0 of {comm.Get_size()})",
                      comm.Get_rank()) as update:
            report = run_staging(plan, comm, update)
    if comm.Get_rank() == 0:
        print(report.describe())


