"""Commands of the performance model and scaling studies: calibrate, plan, scale-study."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.cli.app import ConfigOption, SetOption, app, machine_file, slurm_per_node
from cosmotrain.errors import UserError


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
    from cosmotrain.study.calibrate import (Settings, calibrate as run_calibration,
                                            save_keeping_previous)

    cfg = load_config(config_file, overrides or [])
    comm = world()
    rank = comm.Get_rank()
    settings = Settings(repeats, max_ranks or comm.Get_size())
    machine = run_calibration(cfg, comm, settings,
                              lambda line: print(line, flush=True) if rank == 0 else None)
    if machine is not None:
        path, previous = save_keeping_previous(machine, out or machine_file())
        kept = f" (the calibration there before is kept as {previous})" if previous else ""
        print(f"machine model written to {path}{kept}")


@app.command()
def plan(
    config_file: ConfigOption = None,
    overrides: SetOption = None,
    ranks: Annotated[int, typer.Option(help="Ranks to plan for.", min=1)] = 1,
    memory_per_rank: Annotated[Optional[float], typer.Option(
        help="Drop strategies needing more than this many GiB per rank.", min=0.0)] = None,
    machine: Annotated[Optional[str], typer.Option(
        help="Machine model: a calibrated JSON file or a preset (v100-abci, a100, h100); "
             "default: the calibrated file, else a quick estimate of this machine "
             "(measured once, cached).")] = None,
    ranks_per_node: Annotated[Optional[int], typer.Option(
        help="Ranks per node (default: one per GPU on a GPU preset, else the Slurm "
             "allocation's tasks per node, else all ranks on this node).", min=1)]
    = None,
    top: Annotated[int, typer.Option(help="Rows to show.", min=1)] = 15,
    apply: Annotated[Optional[Path], typer.Option(
        "--apply", help="Write the config with the best strategy's parallel section here.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace the --apply file when it exists.")] = False,
) -> None:
    """Rank the parallel strategies for a config on P ranks by predicted step time."""
    from cosmotrain.cli.machine import command_machine, note
    from cosmotrain.config import load_config
    from cosmotrain.plan.planner import node_layout, plan as make_plan
    from cosmotrain.plan.report import plan_json, plan_table, write_applied

    if apply is not None and apply.exists() and not overwrite:
        raise UserError(f"--apply '{apply}' already exists (a config of yours?); pass "
                        f"--overwrite to replace it, or name a new file")
    cfg = load_config(config_file, overrides or [])
    model, line = command_machine(machine)
    nodes = node_layout(ranks, ranks_per_node, slurm_per_node(), model)
    planned = make_plan(cfg, ranks, model, nodes.per_node,
                        memory_per_rank * 2**30 if memory_per_rank is not None else None)
    if as_json:
        note(line)
        print(json.dumps(plan_json(planned[:top], model, nodes), indent=1))
    else:
        print(line)
        plan_table(planned[:top], cfg, nodes, model)
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
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Move an earlier study in --out into --out/previous-<time>/ "
                            "(its dataset stays, reused) instead of refusing.")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the study in --out (one stopped by its allocation's "
                         "end): keep the points it measured, run the others.")] = False,
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
    if resume and overwrite:
        raise UserError("--resume continues the study in --out and --overwrite starts "
                        "afresh: pass one of them")
    if warmup >= steps:
        raise UserError(f"--warmup {warmup} leaves none of --steps {steps}; use more steps")
    spec = StudySpec(
        config=config_file, ranks=parse_ranks(ranks), mode=mode.value, out=out,
        strategies=parse_strategy_names(strategies) if strategies is not None else None,
        overrides=tuple(overrides or ()), steps=steps, warmup=warmup, machine=machine,
        ranks_per_node=ranks_per_node, launcher=launcher.value, data=data,
        timeout_s=timeout, default_machine=machine_file(), overwrite=overwrite,
        resume=resume)
    results = run_study(spec)
    failed = [p.name for p in results["points"] if p.status == "failed"]
    if failed:
        print(f"cosmotrain: error: scale-study: {len(failed)} point(s) failed: "
              f"{', '.join(failed)}; see {out / 'results.md'}", file=sys.stderr)
        raise typer.Exit(1)
    if not any(p.status == "ok" for p in results["points"]):
        raise UserError(f"scale-study: no point could run; the reasons are in "
                        f"{out / 'results.md'}")


