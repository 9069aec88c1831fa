"""The training loop: epochs of hybrid-parallel steps, validation, checkpoints, metrics.

The trajectory is a function of the config alone: data order of ``(seed, epoch)``,
dropout masks of ``(seed, step, global index)``, the learning rate of the step.  So a run
resumed from a checkpoint (full arrays, any layout) continues exactly where the
uninterrupted run would be: same batches, same masks, same rates, same losses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmotrain.comm.watchdog import Watchdog
from cosmotrain.config.load import dump_yaml
from cosmotrain.device import step_memory
from cosmotrain.errors import UserError
from cosmotrain.nn.module import Context
from cosmotrain.train.outputs import metrics
from cosmotrain.train.checkpoints.checkpoint import (CheckpointState, checkpoint_dir,
                                                      save_checkpoint)
from cosmotrain.train.evaluate import Errors, evaluate
from cosmotrain.train.stops import NonFiniteError, StopSignals, non_finite_message
from cosmotrain.train.job_setup import Job
from cosmotrain.train.outputs.observers import Observer, RunStart
from cosmotrain.engine.schedule import build_schedule
from cosmotrain.engine.votes import Votes
from cosmotrain.train.checkpoints.full_state import full_state, optimizer_blocks, restore
from cosmotrain.train.deferred import Launched, OneBehind

StepHook = Callable[[int, int], None]  # (rank, step about to run): the tests' fault hook


@dataclass
class Position:
    """Where a run stands: optimizer steps taken, epochs completed, samples seen so far."""

    step: int = 0
    epoch: int = 0
    samples: int = 0


@dataclass
class Outcome:
    """How a run ended, for the summary."""

    reason: str = "completed"
    final_loss: float | None = None
    best_mae: float | None = None
    best_epoch: int | None = None
    baseline_mae: float | None = None
    totals: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Runs a :class:`Job` to its end: ``train.epochs`` or ``train.max_steps`` or the
    target MAE, whichever comes first.

    Everything the run reports goes to ``bus`` (made where the run is assembled,
    ``train/run.py``): each event and each record once, whoever listens
    (``metrics.jsonl``, the console, TensorBoard, the MLPerf log).  None: a silent run."""

    def __init__(self, job: Job, signals: StopSignals | None = None,
                 watchdog: Watchdog | None = None, before_step: StepHook | None = None,
                 bus: Observer | None = None) -> None:
        self.job, self.cfg = job, job.cfg
        self.before_step = before_step
        self.bus = bus if bus is not None else Observer()
        self.signals = signals if signals is not None else StopSignals(())
        self.watchdog = watchdog
        self.last_checkpoint: str | None = None
        self.train_reader = job.readers["train"]
        val = job.readers.get("validation")
        self.val_reader = val if val is not None and val.count > 0 else None
        self.schedule = build_schedule(self.cfg)
        self.per_epoch = self.train_reader.batches_per_epoch
        if self.per_epoch == 0:
            raise UserError(f"the training split has {self.train_reader.count} sample(s), "
                            f"fewer than one batch of train.batch_size="
                            f"{self.cfg.train.batch_size}; lower it or add data")
        self.total = self._total_steps()
        self.position = Position()
        self.outcome = Outcome()
        self.validated_at: int | None = None  # the step of the last validation
        self.reader = OneBehind(self._account)  # a device step's values: one step late

    def _total_steps(self) -> int:
        total = self.cfg.train.epochs * self.per_epoch
        limit = self.cfg.train.max_steps
        return min(total, limit) if limit is not None else total

    def epoch_of(self, step: int) -> int:
        """The epoch, counted from 1, that step ``step`` belongs to: the ``epoch`` of a
        metrics record (``metrics.epoch_of``)."""
        return metrics.epoch_of(step, self.per_epoch)

    @property
    def finished(self) -> bool:
        """Whether the position is already at the end (a resumed run that had finished)."""
        return self.position.step >= self.total

    def resume(self, state: CheckpointState, source: str) -> None:
        """Continue from ``state`` (a checkpoint already checked against this config)."""
        restore(self.job.step, state.params, state.buffers, state.optimizer, source)
        self.position = Position(state.step, state.epoch, state.samples_seen)
        if float(state.rng.get("best_mae", -1.0)) >= 0:  # -1: no validation yet
            self.outcome.best_mae = float(state.rng["best_mae"])
            self.outcome.best_epoch = int(state.rng["best_epoch"])

    def run(self, resumed: bool = False) -> dict[str, Any]:
        """Train to the end; returns the summary record (every rank)."""
        self.outcome.baseline_mae = self._baseline_mae()
        self._first_samples = self.position.samples
        self.bus.run_start(self._run_start(resumed))
        start = time.perf_counter()
        self._loop()
        summary = self._summary(time.perf_counter() - start)
        self.bus.record(summary)
        self.bus.run_stop(summary)
        return summary

    def _run_start(self, resumed: bool) -> RunStart:
        job = self.job
        val = self.val_reader.count if self.val_reader is not None else 0
        return RunStart(self.cfg, job.out_dir, job.comm.Get_size(), _nodes(job.comm),
                        self.train_reader.count, val, self.per_epoch, self.total,
                        self.position.step, resumed, job.step.device)

    def _loop(self) -> None:
        pos = self.position
        self.position_at_start = pos.step  # a resumed run tells the epoch it resumes into
        while pos.step < self.total:
            index = pos.step - pos.epoch * self.per_epoch
            if index == 0 or pos.step == self.position_at_start:
                self.bus.epoch_start(pos.epoch + 1)
            stop = self._train_step(pos, index)
            self._beat()
            epoch_done = pos.step - pos.epoch * self.per_epoch == self.per_epoch
            if epoch_done:
                self.bus.epoch_stop(pos.epoch + 1)
            pos.epoch += int(epoch_done)
            if stop:  # every rank agreed in this step's loss allreduce
                self.outcome.reason = "interrupted"
                self._checkpoint()
                return
            if epoch_done:
                if self._end_of_epoch():
                    return
            elif self._due(self.cfg.train.checkpoint_every_steps, pos.step):
                self._checkpoint()
        self.outcome.reason = "max_steps" if pos.step < self.cfg.train.epochs * \
            self.per_epoch else "completed"
        self._validate_at_end()
        self._checkpoint()

    def _validate_at_end(self) -> None:
        """Validate the final parameters unless the last validation saw them: a run that
        ``train.max_steps`` stops within an epoch, or whose last epoch ``validate_every``
        skips, still reports its validation error (``validate_every: 0`` means never)."""
        if self.val_reader is None or not self.cfg.train.validate_every \
                or self.validated_at == self.position.step:
            return
        self._require_finite()
        self._validate()

    def _train_step(self, pos: Position, index: int) -> bool:
        """One optimizer step; True when some rank asked to stop (agreed on every rank).

        A device step's loss and votes are read one step late (``train/deferred.py``),
        but never past a boundary where the loop may checkpoint or validate."""
        job = self.job
        if self.before_step is not None:
            self.before_step(job.rank, pos.step)
        started = time.perf_counter()
        lr = self.schedule(pos.step, self.per_epoch)
        ctx = Context(step=pos.step, seed=self.cfg.train.seed)
        # the batch is read and freed inside the step's planned memory: its arrays take
        # planned pages too, not heap pages beside the step's (device/step_memory.py)
        with step_memory.phase("train"):
            batch = self.train_reader.batch(pos.epoch, index)
            samples = len(batch.indices)
            out = job.step(batch.x, batch.targets, ctx, lr,
                           votes=Votes(stop=int(self.signals.requested)),
                           transform=batch.device_transform)
            del batch
        pos.step += 1
        pos.samples += samples
        launched = Launched(out, pos.step, pos.samples, samples, lr, started,
                            job.step.runtime.timers.take(),
                            self.train_reader.stats.last_wait_seconds, self._io())
        settle = pos.step == self.total or index + 1 == self.per_epoch or \
            self._due(self.cfg.train.checkpoint_every_steps, pos.step)
        return self.reader.push(launched, settle)

    def _account(self, done: Launched, wall: float) -> bool:
        """Check and record a step whose loss and votes are read now (the host's one
        wait for it); True when some rank asked to stop in it."""
        out = done.out
        if not out.finite:
            raise NonFiniteError(non_finite_message(done.step, out.loss,
                                                    out.votes.bad_gradients))
        self.outcome.final_loss = out.loss
        times = metrics.time_breakdown(wall, done.timers, done.wait_s)
        for key, value in times.items():
            self.outcome.totals[key] = self.outcome.totals.get(key, 0.0) + value
        if done.step % self.cfg.train.log_every == 0 or done.step == self.total \
                or out.votes.stop:
            record = metrics.train_record(
                step=done.step, epoch=self.epoch_of(done.step), samples=done.samples,
                loss=out.loss, lr=done.lr,
                samples_per_s=done.batch / wall, time_s=times,
                memory_hwm_mib=self._memory(), io=done.io)
            self.bus.record(record)
        return out.votes.stop > 0

    def _end_of_epoch(self) -> bool:
        """Validate and checkpoint as configured; True when the target MAE is reached."""
        pos, train = self.position, self.cfg.train
        reached = False
        if self.val_reader is not None and self._due(train.validate_every, pos.epoch):
            self._require_finite()
            errors = self._validate()
            reached = train.target_mae is not None and errors.mean_mae <= train.target_mae
        if reached:
            self.outcome.reason = "target_mae"
            self._checkpoint()
        elif self._due(train.checkpoint_every_epochs, pos.epoch) and pos.step < self.total:
            self._checkpoint()
        return reached

    def _validate(self) -> Errors:
        started = time.perf_counter()
        step = self.validated_at = self.position.step
        epoch = self.epoch_of(step)  # the epoch just finished, or stopped within
        self.bus.eval_start(epoch)
        errors = evaluate(self.job.step, self.val_reader, self.cfg.model.outputs,
                          on_batch=self._beat)
        self.bus.eval_stop(epoch)
        if self.outcome.best_mae is None or errors.mean_mae < self.outcome.best_mae:
            self.outcome.best_mae, self.outcome.best_epoch = errors.mean_mae, epoch
        record = metrics.validation_record(
            step=step, epoch=epoch, samples=errors.count,
            mse_per_param=errors.mse.tolist(), mae_per_param=errors.mae.tolist(),
            wall_s=time.perf_counter() - started)
        self.bus.record(record)
        return errors

    @staticmethod
    def _due(every: int | None, count: int) -> bool:
        return bool(every) and count % every == 0  # type: ignore[operator]

    def _io(self) -> dict[str, float]:
        """This rank's reading for the last batch, and its file bandwidth so far."""
        stats = self.train_reader.stats
        rate = stats.bytes_read / stats.read_seconds if stats.read_seconds > 0 else 0.0
        return {"read_mib": stats.last_bytes_read / 2**20,
                "received_mib": stats.last_bytes_received / 2**20,
                "read_mib_per_s": rate / 2**20}

    def _memory(self) -> list[float]:
        return [float(m) for m in self.job.comm.allgather(metrics.memory_hwm_mib())]

    def _checkpoint(self) -> None:
        """Gather the full state onto rank 0 and write it there.  Only rank 0's
        channel/filter group gathers: every other group holds replicas of its blocks."""
        self._require_finite()
        with self._long_phase():
            self._write_checkpoint()
        self._beat()

    def _write_checkpoint(self) -> None:
        job, pos = self.job, self.position
        optimizer = optimizer_blocks(job.step)  # collective when the state is sharded
        if job.grid.group_comms["data"].Get_rank() != 0:  # not rank 0's group
            return
        gathered = full_state(job.step, root=0, optimizer=optimizer)
        if job.rank != 0:
            return
        params, buffers, optimizer = gathered
        best = self.outcome.best_mae
        state = CheckpointState(
            step=pos.step, epoch=pos.epoch, samples_seen=pos.samples, params=params,
            buffers=buffers, optimizer=optimizer, config_yaml=dump_yaml(self.cfg),
            rng={"seed": self.cfg.train.seed, "best_mae": -1.0 if best is None else best,
                 "best_epoch": -1 if self.outcome.best_epoch is None else
                 self.outcome.best_epoch},
            layout={"strategy": job.grid.layout.describe(), "ranks": job.comm.Get_size()})
        self.last_checkpoint = str(save_checkpoint(checkpoint_dir(job.out_dir), state,
                                                   self.cfg.train.keep_checkpoints))

    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(self.position.step)

    def _long_phase(self) -> Any:
        """A checkpoint write: rank 0's peers wait for it in their next collective, so
        the watchdog gives it one more timeout before it counts as no progress."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.allow(self.watchdog.timeout_s)

    def _require_finite(self) -> None:
        """Stop (every rank alike) before a non-finite value is validated or stored."""
        bad = self.job.step.non_finite_ranks()
        if bad:
            raise NonFiniteError(
                f"training stopped after step {self.position.step}: a parameter, gradient "
                f"or optimizer value went non-finite on {bad} rank(s); no checkpoint "
                f"holds it. Lower optimizer.lr (or add warm-up), then resume from the "
                f"last checkpoint with --resume")

    def _baseline_mae(self) -> float | None:
        """MAE of predicting the training labels' mean on the validation set."""
        if self.val_reader is None:
            return None
        manifest = self.job.manifest
        train = manifest.targets("train", np.arange(manifest.count("train")))
        val = manifest.targets("validation", np.arange(manifest.count("validation")))
        return float(np.mean(np.abs(val - train.mean(axis=0))))

    def _summary(self, wall: float) -> dict[str, Any]:
        pos, out = self.position, self.outcome
        return metrics.summary_record(
            step=pos.step, epoch=self.epoch_of(pos.step), samples=pos.samples,
            ranks=self.job.comm.Get_size(), wall_s=wall,
            samples_per_s=(pos.samples - self._first_samples) / wall if wall > 0 else 0.0,
            final_loss=out.final_loss, best_mae=out.best_mae, best_mae_epoch=out.best_epoch,
            stop_reason=out.reason, time_s=out.totals or metrics.time_breakdown(0.0, {}),
            memory_hwm_mib=self._memory())



def _nodes(comm: Any) -> int:
    """Nodes of the job: distinct host names (collective)."""
    import socket

    return len(set(comm.allgather(socket.gethostname())))
