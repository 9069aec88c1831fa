"""The ``cosmotrain`` command line (Typer).

Thin by design: parse arguments, load the config, call the library, and map errors to exit
codes.  A :class:`~cosmotrain.errors.UserError` prints one line and exits 2 with no
traceback; any other exception prints its traceback and aborts the whole MPI job, so a
failure on one rank never leaves the others hanging.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.errors import UserError
from cosmotrain.exits import (EXIT_KEYBOARD, FAULT_ENV, exit_code, fault_hook,
                              report_user_error)


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Hybrid-parallel training of 3D CNNs (CosmoFlow, 3D ResNet) on large volumes.",
)

ConfigOption = Annotated[Optional[Path], typer.Option(
    "--config", "-c", help="YAML config file (see configs/).")]
SetOption = Annotated[Optional[list[str]], typer.Option(
    "--set", "-s", help="Override a config key: --set train.batch_size=8 (repeatable).")]


def _machine_file() -> Path:
    """``$COSMOTRAIN_MACHINE``, else ``$XDG_CACHE_HOME`` (or ~/.cache)/cosmotrain/machine.json."""
    return Path(os.environ.get("COSMOTRAIN_MACHINE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cosmotrain" / "machine.json")


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
    from cosmotrain.config import dump_yaml, load_config, resolve_parallel
    from cosmotrain.config.reference import reference_markdown

    if reference:
        print(reference_markdown())
        return
    cfg = load_config(config_file, overrides or [])
    world_size = ranks if ranks is not None else world().Get_size()
    layout = resolve_parallel(cfg, world_size)
    if world().Get_rank() == 0:
        print(f"# strategy {layout.describe()} on {world_size} rank(s)")
        print(dump_yaml(cfg), end="")


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


@app.command()
def train(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint in output.dir (any layout).")]
    = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the config and print the plan (layout, spatial stop, "
                          "channel algorithms, memory) without reading data or training.")]
    = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Start afresh in an output.dir that holds another run: its "
                            "checkpoints, metrics and config are moved into "
                            "output.dir/previous-<time>/ (never deleted).")] = False,
) -> None:
    """Train a model: mpiexec -n P cosmotrain train --config configs/X.yaml [--set k=v]."""
    from cosmotrain.comm import world
    from cosmotrain.config import load_config
    from cosmotrain.train.guard import EXIT_INTERRUPTED
    from cosmotrain.train.runner import describe_plan, run_training

    cfg = load_config(config_file, overrides or [])
    comm = world()
    if dry_run:
        text = describe_plan(cfg, comm, _machine_file())
        if comm.Get_rank() == 0:
            print(text)
        return
    if resume and overwrite:
        raise UserError("--resume continues the run in output.dir and --overwrite starts "
                        "a new one there: pass only one of them")
    summary = run_training(cfg, comm, resume=resume, overwrite=overwrite,
                           job_id=os.environ.get("SLURM_JOB_ID"), machine_path=_machine_file(),
                           before_step=fault_hook(os.environ.get(FAULT_ENV)))
    if summary is not None and summary["stop_reason"] == "interrupted":
        raise typer.Exit(EXIT_INTERRUPTED)


@app.command()
def predict(
    checkpoint: Annotated[Path, typer.Option(
        help="A checkpoint written by cosmotrain train (output.dir/checkpoints/*.h5).")],
    data: Annotated[Path, typer.Option(
        help="Dataset directory to predict (labelled or not; any layout the readers know).")],
    out: Annotated[Path, typer.Option(help="HDF5 file to write the predictions to.")],
    split: Annotated[Optional[list[str]], typer.Option(
        help="Only this split of the dataset (repeatable; default: every split).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Samples per global batch (default: the training batch, rounded up to a "
             "multiple of the sample groups).", min=1)] = None,
    overrides: SetOption = None,
) -> None:
    """Per-sample predictions in dataset order at any rank count (and MAE when labelled)."""
    from cosmotrain.comm import world
    from cosmotrain.train.predict import describe, run_prediction

    extra = [f"train.batch_size={batch_size}"] if batch_size is not None else []
    comm = world()
    results = run_prediction(checkpoint, data, out, comm, [*(overrides or []), *extra], split)
    if results is not None:
        print("\n".join(describe(results, out)))


@app.command()
def calibrate(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Machine file to write (default: $COSMOTRAIN_MACHINE, else "
             "~/.cache/cosmotrain/machine.json).")] = None,
    max_ranks: Annotated[Optional[int], typer.Option(
        help="Time the layer shapes of strategies up to this many ranks (default: the "
             "job size).", min=1)] = None,
    repeats: Annotated[int, typer.Option(help="Timings per measurement (median).", min=1)]
    = 3,
) -> None:
    """Fit the performance model's constants on this machine (run under mpiexec -n P)."""
    from cosmotrain.comm import world
    from cosmotrain.config import load_config
    from cosmotrain.study.calibrate import Settings, calibrate as run_calibration

    cfg = load_config(config_file, overrides or [])
    comm = world()
    rank = comm.Get_rank()
    settings = Settings(repeats, max_ranks or comm.Get_size())
    machine = run_calibration(cfg, comm, settings,
                              lambda line: print(line, flush=True) if rank == 0 else None)
    if machine is not None:
        path = machine.save(out or _machine_file())
        print(f"machine model written to {path}")


@app.command()
def plan(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    ranks: Annotated[int, typer.Option(help="Ranks to plan for.", min=1)] = 1,
    memory_per_rank: Annotated[Optional[float], typer.Option(
        help="Drop strategies needing more than this many GiB per rank.", min=0.0)] = None,
    machine: Annotated[Optional[str], typer.Option(
        help="Machine model: a calibrated JSON file or a preset (v100-abci, a100, h100); "
             "default: the calibrated file.")] = None,
    ranks_per_node: Annotated[Optional[int], typer.Option(
        help="Ranks per node (default: the machine's cores or GPUs per node).", min=1)]
    = None,
    top: Annotated[int, typer.Option(help="Rows to show.", min=1)] = 15,
    apply: Annotated[Optional[Path], typer.Option(
        "--apply", help="Write the config with the best strategy's parallel section here.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Rank the parallel strategies for a config on P ranks by predicted step time."""
    from cosmotrain.config import load_config
    from cosmotrain.plan.planner import load_machine, plan as make_plan
    from cosmotrain.plan.report import plan_json, plan_table, write_applied

    cfg = load_config(config_file, overrides or [])
    model = load_machine(machine, _machine_file())
    planned = make_plan(cfg, ranks, model, ranks_per_node,
                        memory_per_rank * 2**30 if memory_per_rank is not None else None)
    if as_json:
        print(json.dumps(plan_json(planned[:top], model), indent=1))
    else:
        plan_table(planned[:top], cfg, ranks, model)
    if apply is not None:
        print(f"wrote {write_applied(cfg, planned[0].strategy, apply)} "
              f"(parallel: {planned[0].strategy.describe()})")


class StudyMode(str, Enum):
    strong = "strong"
    weak = "weak"


class StudyLauncher(str, Enum):
    auto = "auto"
    srun = "srun"
    mpiexec = "mpiexec"


@app.command("scale-study")
def scale_study(
    config_file: ConfigOption = None,
    ranks: Annotated[Optional[str], typer.Option(
        help="Rank counts to measure, e.g. 1,2,4,8.")] = None,
    mode: Annotated[StudyMode, typer.Option(
        help="strong: the global batch stays train.batch_size; weak: the batch is "
             "train.batch_size x P.")] = StudyMode.strong,
    strategies: Annotated[Optional[str], typer.Option(
        help="Comma-separated strategies, each measured at the rank count it fits: names "
             "(N4, D2H2, C2F2:w, D2H2@pool4) or, for every P, data (N{P}), spatial (P over "
             "depth, height, width), depth/height/width, plan (the planner's choice). "
             "Default: data, spatial and (with a machine model) plan.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Output directory: results.json/.csv/.md, plots, points/, data/.")] = None,
    steps: Annotated[int, typer.Option(help="Training steps per point.", min=2)] = 6,
    warmup: Annotated[int, typer.Option(
        help="Steps left out before the median (at least the first).", min=1)] = 1,
    overrides: SetOption = None,
    machine: Annotated[Optional[str], typer.Option(
        help="Machine model for predicted times and 'plan': a preset (h100, ...), a JSON "
             "file, or none (default: the calibrated file, if any).")] = None,
    ranks_per_node: Annotated[Optional[int], typer.Option(
        help="Ranks per node of the points (srun layout and predictions; default: the "
             "allocation's --ntasks-per-node under Slurm, else all on one node).",
        min=1)] = None,
    launcher: Annotated[StudyLauncher, typer.Option(
        help="auto: srun inside a Slurm allocation, else mpiexec.")] = StudyLauncher.auto,
    data: Annotated[Optional[Path], typer.Option(
        help="Use this dataset instead of generating a synthetic one in OUT/data.")] = None,
    timeout: Annotated[Optional[float], typer.Option(
        help="Seconds after which a point is stopped and recorded as failed.",
        min=1)] = None,
    report: Annotated[Optional[Path], typer.Option(
        "--report", help="Only re-render results.csv/.md and the plots of the study in "
                         "this directory from its results.json (with --machine: price the "
                         "measured points again on that model first).")] = None,
) -> None:
    """Measured strong or weak scaling: one short training run per point, tables, plots,
    measured vs predicted."""
    from cosmotrain.study.scale import StudySpec, reprice, run_study
    from cosmotrain.study.points import parse_ranks, parse_strategy_names
    from cosmotrain.study.report import load_results, render, write_results

    if report is not None:
        results = load_results(report)
        if machine is not None:  # price the measured points again on this machine model
            results = reprice(results, machine)
            write_results(results, report)
        for path in render(results, report):
            print(f"scale-study: wrote {path}")
        return
    missing = [name for name, value in (("--config", config_file), ("--ranks", ranks),
                                        ("--out", out)) if value is None]
    if missing:
        raise UserError(f"scale-study needs {', '.join(missing)} (or --report DIR); e.g. "
                        f"cosmotrain scale-study --config configs/tiny.yaml --ranks 1,2 "
                        f"--out runs/study")
    if warmup >= steps:
        raise UserError(f"--warmup {warmup} leaves none of --steps {steps}; use more steps")
    spec = StudySpec(
        config=config_file, ranks=parse_ranks(ranks), mode=mode.value, out=out,
        strategies=parse_strategy_names(strategies) if strategies is not None else None,
        overrides=tuple(overrides or ()), steps=steps, warmup=warmup, machine=machine,
        ranks_per_node=ranks_per_node, launcher=launcher.value, data=data,
        timeout_s=timeout, default_machine=_machine_file())
    results = run_study(spec)
    failed = [p.name for p in results["points"] if p.status == "failed"]
    if failed:
        print(f"cosmotrain: error: scale-study: {len(failed)} point(s) failed: "
              f"{', '.join(failed)}; see {out / 'results.md'}", file=sys.stderr)
        raise typer.Exit(1)
    if not any(p.status == "ok" for p in results["points"]):
        raise UserError(f"scale-study: no point could run; the reasons are in "
                        f"{out / 'results.md'}")


def main() -> None:
    """Console-script entry point with the error-to-exit-code mapping."""
    from cosmotrain.comm import abort_job

    try:
        app()
    except UserError as err:
        report_user_error(err)
        sys.exit(exit_code(err))
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint, but no rank left behind
        print("cosmotrain: interrupted again: stopping at once (no checkpoint)",
              file=sys.stderr, flush=True)
        abort_job(EXIT_KEYBOARD)
        sys.exit(EXIT_KEYBOARD)
    except Exception:  # noqa: BLE001 - a bug: show it, and never leave other ranks hanging
        traceback.print_exc()
        sys.stderr.flush()
        abort_job(1)
        sys.exit(1)
