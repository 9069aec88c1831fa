"""``cosmotrain train``: set up the job, resume if asked, train, report; and ``--dry-run``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.comm.watchdog import Watchdog
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.schema import Config
from cosmotrain.device.select import select_device
from cosmotrain.errors import UserError
from cosmotrain.layers.channel_conv import ChannelConv3d
from cosmotrain.plan.planner import choose_parallel
from cosmotrain.config.load import save_resolved
from cosmotrain.train.claim import Claim, claim_output_dir, move_aside_outputs
from cosmotrain.train.guard import StopSignals
from cosmotrain.train.job import build_job
from cosmotrain.train.observers import make_observers
from cosmotrain.train.resume import find_resume_point
from cosmotrain.train.step import hybrid_step_from_config, job_runtime
from cosmotrain.train.trainer import StepHook, Trainer


def run_training(cfg: Config, comm: Any, resume: bool = False, overwrite: bool = False,
                 job_id: str | None = None, before_step: StepHook | None = None,
                 machine_path: Path | None = None) -> dict[str, Any] | None:
    """Train ``cfg`` on ``comm`` (collective); returns the summary record, or None when
    ``resume`` found the run already finished.

    ``before_step(rank, step)`` runs before every step (the CLI's fault injection for
    the abort tests); ``machine_path``, the CLI's default machine file, is for ``parallel:
    auto``.  ``output.dir`` is claimed first (writable, locked, not another run's unless
    ``resume`` or ``overwrite``), and config.yaml is written only once the job is built
    and a resumed checkpoint has been checked against the config.
    """
    cfg, chosen = choose_parallel(cfg, comm, machine_path)
    mode = "resume" if resume else "overwrite" if overwrite else "fresh"
    claim = claim_output_dir(cfg.output.dir, comm, mode, job_id)
    try:
        return _train_claimed(cfg, comm, mode, claim, chosen, before_step)
    finally:
        claim.release()


def _train_claimed(cfg: Config, comm: Any, mode: str, claim: Claim, chosen: str | None,
                   before_step: StepHook | None) -> dict[str, Any] | None:
    rank0 = comm.Get_rank() == 0
    _say(rank0, [*claim.notes, *([chosen] if chosen else [])])
    point = find_resume_point(claim.out_dir, cfg, comm) if mode == "resume" else None
    resumed = point is not None and point.state is not None
    if point is not None:
        _say(rank0, point.notes)
    job = build_job(cfg, comm)
    if mode == "overwrite" or (point is not None and not resumed):
        # only now: a config that fails its checks moves nothing
        _say(rank0, move_aside_outputs(claim, comm))
        if point is not None:
            _say(rank0, [f"cosmotrain: no intact checkpoint under {claim.out_dir}/"
                         f"checkpoints: starting afresh"])
    if job.step.device.is_gpu:
        _say(rank0, [f"device (rank 0): {job.step.device.describe()}"])
    observer = make_observers(cfg, job.out_dir, comm.Get_rank())
    with StopSignals() as signals, _watchdog(cfg, comm) as watchdog, \
            contextlib.closing(observer):
        trainer = Trainer(job, signals, watchdog, before_step, observer)
        if rank0:  # the config has passed every check: the job is built, the resume fits
            save_resolved(cfg, job.out_dir)
        if resumed:
            trainer.resume(point.state, str(point.path))
            if trainer.finished:
                _say(rank0, [finished_line(point.state.step, point.state.epoch)])
                job.grid.free()
                return None
        summary = trainer.run(resumed)
    if rank0:
        print(baseline_line(trainer.outcome.best_mae, trainer.outcome.baseline_mae))
        if summary["stop_reason"] == "interrupted":
            print(interrupted_line(signals, summary, trainer.last_checkpoint), flush=True)
    job.grid.free()
    return summary


def _watchdog(cfg: Config, comm: Any) -> Any:
    """The job's watchdog (``train.watchdog_s``; collective), or a stand-in when off."""
    if cfg.train.watchdog_s is None:
        return contextlib.nullcontext()
    return Watchdog(comm, cfg.train.watchdog_s)


def _say(rank0: bool, lines: list[str]) -> None:
    if rank0 and lines:
        print("\n".join(lines), flush=True)


def finished_line(step: int, epoch: int) -> str:
    """What ``--resume`` says of a run that had already reached its end."""
    return (f"cosmotrain: the run already finished at step {step} (epoch {epoch}): nothing "
            f"to do; raise train.epochs or train.max_steps to train further")


def interrupted_line(signals: StopSignals, summary: dict[str, Any],
                     checkpoint: str | None) -> str:
    """What rank 0 says after a clean stop on a signal: where, what was saved, what next."""
    cause = f"{signals.name} received" if signals.requested else "a stop signal on another rank"
    return (f"cosmotrain: interrupted ({cause}) after step {summary['step']} (epoch "
            f"{summary['epoch']}); checkpoint {checkpoint} written; continue with the same "
            f"command and --resume")


def baseline_line(best: float | None, baseline: float | None) -> str:
    """How the best validation MAE compares with predicting the training labels' mean."""
    if best is None or not baseline:
        return "no validation MAE (no validation split, or train.validate_every: 0)"
    return (f"best validation MAE {best:.4f} = {best / baseline:.2f} x the predict-the-mean "
            f"baseline ({baseline:.4f})")


def describe_plan(cfg: Config, comm: Any, machine_path: Path | None = None) -> str:
    """The run's plan without data: layout, spatial stop, channel algorithms, weights."""
    cfg, chosen = choose_parallel(cfg, comm, machine_path)
    layout = resolve_parallel(cfg, comm.Get_size())
    device = select_device(cfg.device, comm)
    grid = ProcessGrid(comm, layout)
    try:
        step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
    except UserError:
        grid.free()
        raise
    model = step.model
    held = sum(p.data.nbytes for _, p in model.named_parameters())
    lines = [chosen] if chosen else []
    lines += [f"layout: {grid.layout.describe()} on {comm.Get_size()} rank(s); model "
             f"{cfg.model.name} at W={cfg.model.width}, batch {cfg.train.batch_size}",
             f"device (rank 0): {device.describe()}",
             f"first layer on whole samples: {model.stop or '(none)'}",
             f"parameters held per rank: {held / 2**20:.1f} MiB (+ gradients and optimizer "
             f"state)"]
    algorithms = [f"{name}={layer.algorithm}" for name, layer in model.spatial.named_layers()
                  if isinstance(layer, ChannelConv3d)]
    if algorithms:
        lines.append("channel/filter algorithms: " + ", ".join(algorithms))
    grid.free()
    return "\n".join(lines)
