"""``cosmotrain train``: set up the job, resume if asked, train, report; and ``--dry-run``."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from cosmotrain.comm.watchdog import Watchdog
from cosmotrain.config.schema import Config
from cosmotrain.device.select import select_device
from cosmotrain.layers.channel_conv import ChannelConv3d
from cosmotrain.plan.planner import NodeLayout
from cosmotrain.train.auto_layout import choose_parallel
from cosmotrain.comm import node_ranks
from cosmotrain.comm.collective import on_root
from cosmotrain.train.dry_run import layout_plan, memory_check
from cosmotrain.config.load import save_resolved
from cosmotrain.train.claim import Claim, claim_output_dir, move_aside_outputs
from cosmotrain.train.stops import StopSignals
from cosmotrain.data.synthetic.builtin import ensure_synthetic_data
from cosmotrain.train.job_setup import build_job, build_step
from cosmotrain.train.outputs.metrics import MetricsFile
from cosmotrain.train.outputs.mlperf import MLPerfLogObserver
from cosmotrain.train.outputs.mlperf_writer import require_mllog
from cosmotrain.train.outputs.observers import Observer, Observers
from cosmotrain.train.outputs.progress import TrainProgress
from cosmotrain.train.outputs.tensorboard import TensorBoardLog, require_tensorboardx
from cosmotrain.train.checkpoints.resume import find_resume_point
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
    started = time.time()  # the job's start, for the MLPerf log's init_start
    with StopSignals(at_once=True) as signals:  # start-up and the preload pass: exit 75
        cfg, chosen = choose_parallel(cfg, comm, machine_path)
        mode = "resume" if resume else "overwrite" if overwrite else "fresh"
        claim = claim_output_dir(cfg.output.dir, comm, mode, job_id)
        try:
            return _train_claimed(cfg, comm, mode, claim, chosen, before_step, started,
                                  signals)
        finally:
            claim.release()


def _train_claimed(cfg: Config, comm: Any, mode: str, claim: Claim, chosen: str | None,
                   before_step: StepHook | None, started: float, signals: StopSignals
                   ) -> dict[str, Any] | None:
    rank0 = comm.Get_rank() == 0
    _say(rank0, [*claim.notes, *([chosen] if chosen else []), outputs_line(claim.out_dir)])
    point = find_resume_point(claim.out_dir, cfg, comm) if mode == "resume" else None
    resumed = point is not None and point.state is not None
    if point is not None:
        _say(rank0, point.notes)
    generated = ensure_synthetic_data(cfg, comm)
    _say(rank0, [generated] if generated else [])
    job = build_job(cfg, comm)
    if mode == "overwrite" or (point is not None and not resumed):
        # only now: a config that fails its checks moves nothing
        _say(rank0, move_aside_outputs(claim, comm))
        if point is not None:
            _say(rank0, [f"cosmotrain: no intact checkpoint under {claim.out_dir}/"
                         f"checkpoints: starting afresh"])
    if job.step.device.is_gpu:
        _say(rank0, [f"device (rank 0): {job.step.device.describe()}"])
    bus = run_bus(cfg, job.out_dir, comm.Get_rank(), started)
    with _watchdog(cfg, comm) as watchdog, \
            contextlib.closing(bus):  # closed also when the run fails: files, live bar
        trainer = Trainer(job, signals, watchdog, before_step, bus)
        if rank0:  # the config has passed every check: the job is built, the resume fits
            save_resolved(cfg, job.out_dir)
        if resumed:
            trainer.resume(point.state, str(point.path))
            if trainer.finished:
                _say(rank0, [finished_line(point.state.step, point.state.epoch)])
                job.grid.free()
                return None
        signals.defer()  # from the first step on, a signal stops at a step boundary
        summary = trainer.run(resumed)
    if rank0:
        print(baseline_line(trainer.outcome.best_mae, trainer.outcome.baseline_mae,
                            no_validation_reason(cfg, trainer.val_reader is not None)))
        if summary["stop_reason"] == "interrupted":
            print(interrupted_line(signals, summary, trainer.last_checkpoint), flush=True)
    job.grid.free()
    return summary


def run_bus(cfg: Config, out_dir: Path, rank: int, started: float | None = None
            ) -> Observer:
    """The bus the trainer reports to (``train/outputs/observers.py``): on rank 0
    ``metrics.jsonl``, the console and the outputs the config asks for
    (:func:`make_observers`), told in that order; a silent observer on the other ranks."""
    asked = make_observers(cfg, out_dir, rank, started)  # every rank: it checks packages
    if rank != 0:
        return Observer()
    return Observers([MetricsFile(out_dir), TrainProgress(rank=rank), asked])


def make_observers(cfg: Config, out_dir: Path, rank: int,
                   started: float | None = None) -> Observer:
    """The optional outputs ``cfg`` asks for on rank 0 (``output`` section); a silent
    observer on the other ranks and when none is asked for.  ``started``: when the job
    began (``time.time()``; the MLPerf log's ``init_start``).  A missing package stops
    the whole job: every rank checks it."""
    members: list[Observer] = []
    if cfg.output.mlperf_log:
        require_mllog()
        if rank == 0:
            members.append(MLPerfLogObserver(cfg, out_dir, started))
    if cfg.output.tensorboard:
        require_tensorboardx()
        if rank == 0:
            members.append(TensorBoardLog(out_dir))
    if rank != 0:
        return Observer()
    return Observers(members)


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
    return (f"cosmotrain: the run already finished at step {step} ({epochs_complete(epoch)})"
            f": nothing to do; raise train.epochs or train.max_steps to train further")


def epochs_complete(epochs: int) -> str:
    """A checkpoint's ``epoch`` (epochs completed) in words: ``2 epochs complete``."""
    return f"{epochs} epoch{'' if epochs == 1 else 's'} complete"


def interrupted_line(signals: StopSignals, summary: dict[str, Any],
                     checkpoint: str | None) -> str:
    """What rank 0 says after a clean stop on a signal: where, what was saved, what next."""
    cause = f"{signals.name} received" if signals.requested else "a stop signal on another rank"
    return (f"cosmotrain: interrupted ({cause}) after step {summary['step']} (epoch "
            f"{summary['epoch']}); checkpoint {checkpoint} written; continue with the same "
            f"command and --resume")


def outputs_line(out_dir: Path) -> str:
    """Where a run's outputs go, said once at the start."""
    return (f"cosmotrain: outputs in {out_dir}/: metrics.jsonl, checkpoints/, config.yaml "
            f"(output.dir)")


def no_validation_reason(cfg: Config, has_validation: bool) -> str:
    """Why a run that ended has no validation MAE (every run with a validation split
    validates at its end, so only these remain)."""
    if not has_validation:
        return "the dataset has no validation split (or it is empty)"
    if not cfg.train.validate_every:
        return "train.validate_every is 0"
    return "the run stopped before its first validation"


def baseline_line(best: float | None, baseline: float | None, missing: str = "") -> str:
    """How the best validation MAE compares with predicting the training labels' mean;
    ``missing`` says why there is none (:func:`no_validation_reason`)."""
    if best is None:
        return f"no validation MAE: {missing or 'no validation ran'}"
    if not baseline:
        return f"best validation MAE {best:.4f} (the predict-the-mean baseline is 0)"
    return (f"best validation MAE {best:.4f} = {best / baseline:.2f} x the predict-the-mean "
            f"baseline ({baseline:.4f})")


def describe_plan(cfg: Config, comm: Any, machine_path: Path | None = None,
                  nodes: NodeLayout | None = None) -> str:
    """The run's plan without data: layout, spatial stop, channel algorithms, weights, and
    whether a step fits in memory (a user error when not: train/dry_run.py).  ``nodes``
    (``--ranks`` / ``--ranks-per-node``) checks that job size from the model instead."""
    cfg, chosen = choose_parallel(cfg, comm, machine_path, *(
        (nodes.ranks, nodes.per_node) if nodes else ()))
    if nodes is not None:
        device = select_device(cfg.device, comm)
        return "\n".join(([chosen] if chosen else []) +
                         on_root(comm, lambda: layout_plan(cfg, nodes, device)))
    grid, step, device = build_step(cfg, comm)
    layout = grid.layout
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
    job = NodeLayout(comm.Get_size(), node_ranks(comm), "this job's")
    lines += on_root(comm, lambda: memory_check(cfg, layout, job, device))
    return "\n".join(lines)
