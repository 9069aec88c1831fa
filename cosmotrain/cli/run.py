"""Commands that describe and run jobs: info, config, train, predict."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.cli.app import (ConfigOption, SetOption, app, load_user_config,
                                user_cache_dir, with_user_defaults)
from cosmotrain.errors import UserError
from cosmotrain.exits import FAULT_ENV, fault_hook


@app.command()
def info(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Versions, MPI library, world size, rank -> host layout, GPUs, cupy / cuDNN."""
    from cosmotrain.comm import world
    from cosmotrain.info import gather_info
    from cosmotrain.info_report import render_info

    report = gather_info(world())
    if report is None:
        return
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render_info(report)


@app.command()
def config(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    ranks: Annotated[Optional[int], typer.Option(
        help="Check the parallel section for this many ranks (default: this job's size).",
        min=1)] = None,
    reference: Annotated[bool, typer.Option(
        "--reference", help="Print the reference of every config key and exit.")] = False,
) -> None:
    """Validate a config (with --set overrides) and print it fully resolved."""
    from cosmotrain.comm import world
    from cosmotrain.config import dump_yaml, resolve_parallel
    from cosmotrain.config.reference import reference_markdown

    if reference:
        print(reference_markdown())
        return
    cfg = load_user_config(config_file, overrides)
    world_size = ranks if ranks is not None else world().Get_size()
    layout = resolve_parallel(cfg, world_size)
    if world().Get_rank() == 0:
        print(f"# strategy {layout.describe()} on {world_size} rank(s)")
        print(dump_yaml(cfg), end="")



@app.command()
def train(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint in output.dir (any layout).")]
    = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the config and print the plan (layout, spatial stop, "
                          "channel algorithms, memory per rank against this node's) "
                          "without reading data or training; exit 2 if a step does not "
                          "fit.")]
    = False,
    ranks: Annotated[Optional[int], typer.Option(
        help="With --dry-run: check the layout for a job of this many ranks, from the "
             "model, without launching them.", min=1)] = None,
    ranks_per_node: Annotated[Optional[int], typer.Option(
        help="With --dry-run: ranks per node of that job (default: the Slurm allocation's, "
             "else all on this node).", min=1)] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Start afresh in an output.dir that holds another run: its "
                            "checkpoints, metrics and config are moved into "
                            "output.dir/previous-<time>/ (never deleted).")] = False,
) -> None:
    """Train a model: mpiexec -n P cosmotrain train --config configs/X.yaml [--set k=v]."""
    from cosmotrain.comm import world
    from cosmotrain.train.stops import EXIT_INTERRUPTED
    from cosmotrain.cli.machine import auto_machine_path, target_nodes
    from cosmotrain.train.run import describe_plan, run_training

    cfg = with_user_defaults(load_user_config(config_file, overrides))
    comm = world()
    if not dry_run and (ranks or ranks_per_node):
        raise UserError("--ranks and --ranks-per-node only go with --dry-run (a run's size "
                        "is the launcher's: mpiexec -n P)")
    machine_path = auto_machine_path(cfg, comm)
    if dry_run:
        text = describe_plan(cfg, comm, machine_path, target_nodes(ranks, ranks_per_node, comm))
        if comm.Get_rank() == 0:
            print(text)
        return
    if resume and overwrite:
        raise UserError("--resume continues the run in output.dir and --overwrite starts "
                        "a new one there: pass only one of them")
    summary = run_training(cfg, comm, resume=resume, overwrite=overwrite,
                           job_id=os.environ.get("SLURM_JOB_ID"), machine_path=machine_path,
                           before_step=fault_hook(os.environ.get(FAULT_ENV)))
    if summary is not None and summary["stop_reason"] == "interrupted":
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
def predict(
    checkpoint: Annotated[Path, typer.Option(
        help="A checkpoint written by cosmotrain train (output.dir/checkpoints/*.h5).")],
    data: Annotated[Path, typer.Option(
        help="Dataset directory to predict (labelled or not; any layout the readers know).")],
    out: Annotated[Path, typer.Option(
        help="File to write the predictions to: CSV if it ends in .csv, else HDF5.")],
    split: Annotated[Optional[list[str]], typer.Option(
        help="Only this split of the dataset (repeatable; default: every split).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Samples per global batch (default: the training batch, rounded up to a "
             "multiple of the sample groups).", min=1)] = None,
    overrides: SetOption = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace --out when it exists.")] = False,
) -> None:
    """Per-sample predictions in dataset order at any rank count (and MAE when labelled)."""
    from cosmotrain.comm import world
    from cosmotrain.train.predict import describe, run_prediction

    extra = [f"train.batch_size={batch_size}"] if batch_size is not None else []
    comm = world()
    defaults = [f"data.cache_dir={user_cache_dir()}"]  # this machine's; --set still wins
    results = run_prediction(checkpoint, data, out, comm,
                             [*defaults, *(overrides or []), *extra], split, overwrite)
    if results is not None:
        print("\n".join(describe(results, out)))


