"""``cosmotrain scale-study``: measured strong or weak scaling of a config over rank counts.

A study is a list of *points* (a rank count and a parallel strategy, chosen by
:mod:`cosmotrain.study.points`).  Each point is one short ``cosmotrain train`` run
launched by :mod:`cosmotrain.study.launch` (srun inside a Slurm allocation, mpiexec
elsewhere) on one shared synthetic dataset, so the points differ only in the layout (and,
in weak mode, the batch).  Its ``metrics.jsonl`` gives the measured step
(:func:`cosmotrain.study.report.measure`), the planner prices the same config and
strategy for the predicted one, and :mod:`cosmotrain.study.report` writes the tables
and plots.  The driver never initialises MPI itself: it only starts launchers, so it can run in
a Slurm batch step where a second MPI job inside the first would fail.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cosmotrain import __version__
from cosmotrain.files.atomic import check_writable
from cosmotrain.config import Layout, dump_yaml, load_config, resolve_parallel
from cosmotrain.config.schema import Config
from cosmotrain.errors import ConfigError, UserError
from cosmotrain.plan.cost import Prediction
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.planner import plan, price
from cosmotrain.train.auto_layout import load_machine
from cosmotrain.plan.workload import build_workload
from cosmotrain.study import launch
from cosmotrain.study.launch import Launcher
from cosmotrain.study.points import Point, build_points, check_explicit, default_strategies
from cosmotrain.study.report import document, measure, render, write_results
from cosmotrain.study.study_dir import (POINTS_DIR, adopt_measured, claim_study_dir,
                                        measured_before, set_aside_point_dir)

NO_MACHINE = "none"


@dataclass(frozen=True)
class StudySpec:
    """Everything a study needs; the CLI builds it from its options."""

    config: Path
    ranks: tuple[int, ...]
    mode: str
    out: Path
    strategies: tuple[str, ...] | None = None
    overrides: tuple[str, ...] = ()
    steps: int = 6
    warmup: int = 1
    machine: str | None = None
    ranks_per_node: int | None = None
    launcher: str = "auto"
    data: Path | None = None
    timeout_s: float | None = None
    default_machine: Path | None = None  # the calibrated file without --machine (CLI's)
    overwrite: bool = False  # move an earlier study in ``out`` aside (study_dir.py)
    resume: bool = False  # keep the points an earlier study in ``out`` measured


def point_overrides(point: Point, spec: StudySpec, data_dir: Path) -> list[str]:
    """The ``--set`` items of a point's run, after the study's own ``--set`` items.

    Every step is a metrics record, nothing but the final checkpoint is written (the trainer
    always writes one at the end; the study deletes it), no validation, and enough epochs
    for ``steps`` steps on any dataset with one batch or more.
    """
    strategy = Layout.parse(point.strategy)
    return [*spec.overrides, *strategy.overrides(), f"train.batch_size={point.batch}",
            f"train.max_steps={spec.steps}", f"train.epochs={spec.steps}",
            "train.log_every=1", "train.validate_every=0", "train.target_mae=null",
            "train.checkpoint_every_epochs=0", "train.checkpoint_every_steps=null",
            "train.keep_checkpoints=1", "data.source=files", f"data.path={data_dir}",
            f"output.dir={spec.out / POINTS_DIR / point.name}"]


def point_config(point: Point, spec: StudySpec, data_dir: Path) -> Config:
    """The config a point runs (validated like ``cosmotrain train`` would)."""
    return load_config(spec.config, point_overrides(point, spec, data_dir))


def cannot_run(cfg: Config, point: Point) -> str | None:
    """Why ``point`` cannot run (batch, rank count, block sizes, engine plan), or None."""
    try:
        resolve_parallel(cfg, point.ranks)
        build_workload(cfg, Layout.parse(point.strategy))
    except (ConfigError, ValueError) as err:
        return str(err)
    return None


def remove_checkpoints(point_dir: Path) -> None:
    """The final checkpoint every run writes is of no use to a study; it can be large."""
    shutil.rmtree(point_dir / "checkpoints", ignore_errors=True)




def load_study_machine(spec: str | None, default: Path | None = None
                       ) -> tuple[MachineModel | None, str]:
    """The machine model for predictions and ``plan``, and a note saying which.

    Without ``--machine`` the calibrated default is optional (no predictions when there is
    none); a machine asked for by name or file must load; ``none`` switches predictions off.
    """
    if spec == NO_MACHINE:
        return None, "no machine model (--machine none): no predictions"
    try:
        machine = load_machine(spec, default)
    except UserError as err:
        if spec:
            raise
        return None, f"no predictions: {err}"
    return machine, f"predictions from the machine model '{machine.name}'"


def run_study(spec: StudySpec, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every point of ``spec``; write results.json (after each point), results.csv,
    results.md and the plots into ``spec.out``; return the results.  An earlier study in
    ``spec.out`` is refused, with ``spec.overwrite`` moved aside, with ``spec.resume``
    continued: its measured points kept, the others run (``study_dir.py``)."""
    spec = _absolute(spec)
    base = load_config(spec.config, spec.overrides)
    machine, machine_note = load_study_machine(spec.machine, spec.default_machine)
    launcher = launch.find_launcher(spec.launcher, spec.ranks_per_node)
    names = spec.strategies or default_strategies(machine)
    check_explicit(names, spec.ranks)
    if "plan" in names and machine is None:
        raise UserError(f"--strategies plan needs a machine model ({machine_note}); pass "
                        f"--machine FILE or a preset, or drop 'plan'")
    planner = _planner(spec, machine, launcher.ranks_per_node) if machine else None
    points = build_points(names, spec.ranks, base.train.batch_size, spec.mode, planner)
    data_dir = spec.data or spec.out / "data"
    _check_points(points, spec, data_dir, machine, launcher.ranks_per_node)
    results = _results(spec, base, names, launcher, machine, machine_note, data_dir, points)
    kept = adopt_measured(points, measured_before(spec.out, document(results))) \
        if spec.resume else 0
    runnable = [p for p in points if p.status == "pending"]
    for point in runnable:
        launcher.words(point.ranks)  # no launcher for P > 1: one error, before any run
    check_writable(spec.out, "--out")  # a file in the way, read-only: one WriteError line
    # only now, once the spec has passed every check: a bad one moves nothing
    moved = claim_study_dir(spec.out, spec.overwrite, resume=spec.resume)
    echo(f"scale-study: {spec.mode} scaling of {spec.config.name} over ranks "
         f"{','.join(map(str, spec.ranks))}: {len(runnable)} point(s) to run, "
         f"{len(points) - len(runnable) - kept} skipped"
         f"{f', {kept} measured before (--resume)' if kept else ''}; {machine_note}")
    if moved:
        echo(moved)
    if runnable and spec.data is None:
        _ensure_dataset(spec, base, launcher, runnable, echo)
    for number, point in enumerate(runnable, start=1):
        run_point(point, spec, launcher, data_dir, spec.timeout_s)
        echo(f"scale-study: [{number}/{len(runnable)}] {describe_point(point)}")
        write_results(results, spec.out)
    write_results(results, spec.out)
    for path in render(results, spec.out, echo):
        echo(f"scale-study: wrote {path}")
    return results


def _absolute(spec: StudySpec) -> StudySpec:
    data = spec.data.resolve() if spec.data else None
    if data is not None and not (data / "manifest.json").is_file():
        raise UserError(f"--data {spec.data}: no manifest.json there; pass a dataset "
                        f"directory written by cosmotrain datagen (or leave --data out)")
    return replace(spec, config=spec.config.resolve(), out=spec.out.resolve(), data=data)


def _planner(spec: StudySpec, machine: MachineModel, per_node: int | None
             ) -> Callable[[int, int], Layout]:
    def choose(ranks: int, batch: int) -> Layout:
        cfg = load_config(spec.config, [*spec.overrides, f"train.batch_size={batch}"])
        return plan(cfg, ranks, machine, _per_node(ranks, per_node))[0].strategy

    return choose


def _per_node(ranks: int, per_node: int | None) -> int:
    """Ranks per node of a P-rank point: all on one node unless told otherwise."""
    return min(ranks, per_node) if per_node else ranks


def _check_points(points: list[Point], spec: StudySpec, data_dir: Path,
                  machine: MachineModel | None, per_node: int | None) -> None:
    """Skip the points that cannot run (with the reason); price the others."""
    for point in points:
        if point.status != "pending":
            continue
        try:
            cfg = point_config(point, spec, data_dir)
        except UserError as err:
            point.status, point.reason = "skipped", str(err)
            continue
        reason = cannot_run(cfg, point)
        if reason is not None:
            point.status, point.reason = "skipped", reason
            continue
        if machine is not None:
            planned = price(cfg, Layout.parse(point.strategy), machine,
                            _per_node(point.ranks, per_node))
            point.predicted = predicted_dict(planned.prediction, planned.memory_bytes)


def predicted_dict(prediction: Prediction, memory_bytes: float) -> dict[str, Any]:
    """The planner's prediction in results.json's terms."""
    return {"step_s": prediction.step_s, "samples_per_s": prediction.samples_per_s,
            "time_s": dict(prediction.seconds), "comm_share": prediction.comm_share,
            "memory_mib": memory_bytes / 2**20}


def _results(spec: StudySpec, base: Config, names: Sequence[str], launcher: Launcher,
             machine: MachineModel | None, machine_note: str, data_dir: Path, points: list[Point]
             ) -> dict[str, Any]:
    env_keys = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "SLURM_JOB_ID",
                "SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE", "SRUN_CPUS_PER_TASK",
                "SLURM_MPI_TYPE", "SLURM_GPU_BIND")
    return {
        "format": 1, "cosmotrain": __version__, "host": platform.node(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": str(spec.config), "overrides": list(spec.overrides),
        "config_yaml": dump_yaml(base), "model": base.model.name, "width": base.model.width,
        "mode": spec.mode, "ranks": list(spec.ranks), "strategies": list(names),
        "base_batch": base.train.batch_size, "steps": spec.steps, "warmup": spec.warmup,
        "launcher": launcher.kind, "ranks_per_node": launcher.ranks_per_node,
        "machine": machine.name if machine is not None else None, "notes": [machine_note],
        "data": str(data_dir),
        "environment": {k: os.environ[k] for k in env_keys if k in os.environ},
        "points": points,
    }


def _ensure_dataset(spec: StudySpec, base: Config, launcher: Launcher, runnable: list[Point],
                    echo: Callable[[str], None]) -> None:
    """One synthetic dataset for every point: ``steps`` batches of the largest batch (and
    one validation sample), at the config's width and seed; reused when it fits."""
    data_dir = spec.out / "data"
    train = max(p.batch for p in runnable) * spec.steps
    width, seed = base.model.width, base.data.synthetic.seed
    if _dataset_fits(data_dir, train, width, seed):
        echo(f"scale-study: reusing the dataset in {data_dir}")
        return
    samples = train + 1
    ranks = min(max(p.ranks for p in runnable), samples)
    command = launcher.words(ranks) + launch.cosmotrain_command(
        "datagen", "--out", str(data_dir), "--samples", str(samples), "--width", str(width),
        "--seed", str(seed), "--val-fraction", repr(1.0 / samples), "--overwrite")
    echo(f"scale-study: generating {samples} samples of 4 x {width}^3 in {data_dir}")
    done = launch.run_logged(command, spec.out / "datagen", spec.timeout_s)
    if done.exit_code != 0:
        raise UserError(f"cosmotrain datagen for the study failed (exit {done.exit_code}): "
                        f"{launch.last_error_line(done.stderr_tail)}; see "
                        f"{spec.out / 'datagen' / 'stderr.log'}")


def _dataset_fits(data_dir: Path, train: int, width: int, seed: int) -> bool:
    try:
        manifest = json.loads((data_dir / "manifest.json").read_text())
        return (manifest["width"] == width and manifest["seed"] == seed
                and manifest["splits"]["train"]["count"] >= train)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_point(point: Point, spec: StudySpec, launcher: Launcher, data_dir: Path,
              timeout_s: float | None = None) -> None:
    """Run one point and record its outcome: ok with ``measured``, skipped (the trainer
    refused the layout: exit 2), or failed (exit code and stderr)."""
    sets = point_overrides(point, spec, data_dir)
    point.command = launcher.words(point.ranks) + launch.cosmotrain_command(
        "train", "--config", str(spec.config), *[w for s in sets for w in ("--set", s)])
    point_dir = spec.out / POINTS_DIR / point.name
    point.output_dir = str(point_dir)
    set_aside_point_dir(point_dir)  # a resumed study's interrupted attempt is kept
    done = launch.run_logged(point.command, point_dir, timeout_s)
    remove_checkpoints(point_dir)
    point.exit_code, point.stderr_tail = done.exit_code, done.stderr_tail
    if done.timed_out:
        point.status, point.reason = "failed", f"timed out after {timeout_s:g} s"
    elif done.exit_code == 2:
        point.status = "skipped"
        line = launch.last_error_line(done.stderr_tail).removeprefix("cosmotrain: error: ")
        point.reason = f"cosmotrain train refused it: {line}"
    elif done.exit_code != 0:
        point.status, point.reason = "failed", launch.last_error_line(done.stderr_tail)
    else:
        try:
            point.measured = measure(point_dir / "metrics.jsonl", point.batch, spec.warmup)
            point.status = "ok"
        except (UserError, ValueError) as err:
            point.status, point.reason = "failed", str(err)


def describe_point(point: Point) -> str:
    """One line: what ran and what came out."""
    head = f"{point.ranks} rank(s) {point.strategy} batch {point.batch}: "
    if point.status != "ok" or point.measured is None:
        code = f" (exit {point.exit_code})" if point.status == "failed" else ""
        return head + f"{point.status}{code}: {point.reason}"
    text = (f"{point.measured['step_s']:.4g} s/step, "
            f"{point.measured['samples_per_s']:.4g} samples/s")
    if point.predicted:
        text += f" (predicted {point.predicted['step_s']:.4g} s/step)"
    return head + text


def reprice(results: dict[str, Any], machine_spec: str) -> dict[str, Any]:
    """``results`` with every runnable point priced again on another machine model.

    What ``scale-study --report DIR --machine M`` does: compare a study measured once with
    a new calibration (or a preset) without running it again.
    """
    import yaml

    from cosmotrain.config.load import config_from_mapping

    machine = load_machine(machine_spec)
    per_node = results.get("ranks_per_node")
    for point in results["points"]:
        if point["status"] == "skipped":
            continue
        cfg = config_from_mapping(yaml.safe_load(results["config_yaml"]),
                                  [f"train.batch_size={point['batch']}"])
        planned = price(cfg, Layout.parse(point["strategy"]), machine,
                        _per_node(point["ranks"], per_node))
        point["predicted"] = predicted_dict(planned.prediction, planned.memory_bytes)
    results["machine"] = machine.name
    notes = [n for n in results.get("notes", []) if not n.startswith("predictions re-priced")]
    results["notes"] = [*notes, f"predictions re-priced on {machine_spec}"]
    return results

