"""The trainer reads a device step's loss and votes one step late (train/deferred.py).

The real trainer loop runs the real GPU-path step on the stand-in cupy
(tests/standin.py) over a small in-memory reader.  A timeline interleaves the step
launches, the host's reads of each step's values and every synchronisation the ledger
counts, so it shows where the host waits: between launching step k and launching step
k + 1 only the read of step k - 1's values, and at the end (a checkpoint follows) the
last step's.  The records are those of a run that reads every step at once, and a NaN
stops the run before any checkpoint holds it, the parameters untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import abort_on_error
from standin import installed

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.load import load_config
from cosmotrain.data.readers.base import Batch, IOStats
from cosmotrain.device.select import Device
from cosmotrain.engine.device_verdict import DeferredSums
from cosmotrain.engine.step import HybridStep, hybrid_step_from_config, job_runtime
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.train.checkpoints.checkpoint import checkpoint_dir, list_checkpoints
from cosmotrain.train.deferred import OneBehind
from cosmotrain.train.job_setup import Job
from cosmotrain.train.outputs.observers import Observer
from cosmotrain.train.stops import NonFiniteError
from cosmotrain.train.trainer import Trainer

STEPS = 5
CONFIG = ["model.name=cosmoflow", "model.width=16", "model.dropout=0.2",
          "train.batch_size=2", "optimizer.name=sgd", "optimizer.lr=0.002",
          "optimizer.momentum=0.9", "device.conv_algorithm=gemm", "train.epochs=1",
          "train.log_every=1"]


class Batches:
    """A reader of ``STEPS`` batches of one epoch, held in memory; ``bad`` (a step
    index) gets a NaN target."""

    def __init__(self, cfg: Any, model: Any, bad: int | None = None) -> None:
        rng = np.random.default_rng(3)
        size, width = cfg.train.batch_size, cfg.model.width
        self.count, self.batches_per_epoch, self.stats = size * STEPS, STEPS, IOStats()
        self.model, self.bad, self.rng, self.size = model, bad, rng, size
        self.shape = (size, cfg.model.channels, width, width, width)
        self.x = [rng.normal(size=self.shape).astype(np.float32) for _ in range(STEPS)]
        self.y = [rng.normal(size=(size, cfg.model.outputs)).astype(np.float32)
                  for _ in range(STEPS)]

    def batch(self, epoch: int, index: int) -> Batch:
        targets = self.y[index].copy()
        if index == self.bad:
            targets[0, 0] = np.nan
        dist, coord = self.model.input_distribution(self.shape)
        return Batch(DistTensor.scatter(self.x[index], dist, coord), targets,
                     np.arange(index * self.size, (index + 1) * self.size), epoch, index)


class Records(Observer):
    """The train records' figures, in order among the epoch events."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def epoch_start(self, epoch: int) -> None:
        self.events.append(f"epoch {epoch} starts")

    def epoch_stop(self, epoch: int) -> None:
        self.events.append(f"epoch {epoch} ends")

    def record(self, record: Any) -> None:
        if record["kind"] == "train":
            self.events.append({k: record[k] for k in ("step", "epoch", "samples", "loss",
                                                       "lr")})


@dataclass
class Run:
    """What a trainer run showed: its timeline, its records and epoch events, and each
    parameter and optimizer slot before each step (the last entry: after the run)."""

    timeline: list[str] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)  # records' figures, epoch events
    params: list[dict[str, np.ndarray]] = field(default_factory=list)


class Signal:
    """A stop signal that arrives before step index ``at`` (None: never)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.requested = at, False

    def before_step(self, rank: int, step: int) -> None:
        self.requested = self.requested or step == self.at


def train(monkeypatch: pytest.MonkeyPatch, out_dir: Path, run: Run, extra: list[str] = (),
          bad: int | None = None, stop: int | None = None, comm: Any = None
          ) -> dict[str, Any]:
    """A trainer run on the stand-in GPU, seen in ``run`` (filled when it raises too);
    its summary.  ``comm``: the job's ranks (None: this one alone)."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF if comm is None else comm
    cfg = load_config(None, [*CONFIG, *extra])
    bus = Records()
    with installed(monkeypatch) as cupy:
        grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
        device = Device("gpu", 0, cfg.device.precision, "staging", "gemm")
        step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
        reader = Batches(cfg, step.model, bad)
        job = Job(cfg, comm, grid, step, None, {"train": reader}, out_dir)
        signal = Signal(stop)
        try:
            with monkeypatch.context() as watching:  # this run's own: undone after it
                watch(watching, cupy.ledger, run.timeline, run.params, [])
                return Trainer(job, signal, before_step=signal.before_step, bus=bus).run()
        finally:
            run.params.append(snapshot(step))
            run.events[:] = bus.events
            grid.free()


def watch(monkeypatch: pytest.MonkeyPatch, ledger: Any, timeline: list[str],
          params: list[dict[str, np.ndarray]], outputs: list[Any]) -> None:
    """Write into ``timeline`` each step's launch, each read of a step's values (by the
    step's number) and each host synchronisation (with where it came from)."""
    real_sync, real_call, real_read = ledger.sync, HybridStep.__call__, DeferredSums.read

    def sync(why: str) -> None:
        before = len(ledger.syncs)
        real_sync(why)
        if len(ledger.syncs) > before:
            timeline.append(f"sync {why} at {ledger.sync_sites[-1]}")

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        params.append(snapshot(self))
        timeline.append(f"launch {len(outputs) + 1}")
        out = real_call(self, *args, **kwargs)
        outputs.append(out.sums)
        timeline.append(f"launched {len(outputs)}")
        return out

    def read(self: Any) -> Any:
        if self._host is None:
            timeline.append(f"read {[s is self for s in outputs].index(True) + 1}")
        return real_read(self)
    monkeypatch.setattr(ledger, "sync", sync)
    monkeypatch.setattr(HybridStep, "__call__", call)
    monkeypatch.setattr(DeferredSums, "read", read)


def snapshot(step: Any) -> dict[str, np.ndarray]:
    arrays = {name: p.data for name, p in step.model.named_parameters()}
    arrays.update({f"{n}.{k}": v for n, slots in step.optimizer.state.items()
                   for k, v in slots.items()})
    return {name: np.array(a.view(np.ndarray)) for name, a in arrays.items()}


# The staging transport's stream synchronisation (MPI reads host copies), in the step.
TRANSPORT = "sync stream.synchronize at "
READ = "sync asnumpy at device/xp.py:to_host"  # DeferredSums.read: the one host read


def between_launches(timeline: list[str], k: int) -> list[str]:
    """What the host did from the end of step k's launch to the start of step k + 1's."""
    start = timeline.index(f"launched {k}") + 1
    return timeline[start:timeline.index(f"launch {k + 1}")]


def steps_recorded(run: Run) -> list[int]:
    return [event["step"] for event in run.events if isinstance(event, dict)]


def test_the_host_reads_step_k_minus_1_after_launching_step_k(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two epochs of ``STEPS`` steps, a checkpoint at the first one's end: in each epoch
    the host reads step k - 1 between launching step k and step k + 1, and reads the
    epoch's last step at once; the records and epoch events are the eager read's."""
    run = Run()
    train(monkeypatch, tmp_path, run, ["train.epochs=2"])
    timeline, last = run.timeline, 2 * STEPS
    for k in range(1, last + 1):  # nothing inside a step makes the host wait
        inside = timeline[timeline.index(f"launch {k}") + 1:timeline.index(f"launched {k}")]
        assert inside == [], (k, inside)
    for first in (1, STEPS + 1):
        assert between_launches(timeline, first) == []  # its values wait for the next
        for k in range(first + 1, first + STEPS - 1):
            assert between_launches(timeline, k) == [f"read {k - 1}", READ], k
    end_of_epoch = between_launches(timeline, STEPS)
    assert end_of_epoch[:4] == [f"read {STEPS - 1}", READ, f"read {STEPS}", READ]
    end = timeline[timeline.index(f"launched {last}") + 1:]
    assert end[:4] == [f"read {last - 1}", READ, f"read {last}", READ], end
    assert steps_recorded(run) == list(range(1, last + 1))

    push = OneBehind.push  # the eager read: each step's values read right after it
    monkeypatch.setattr(OneBehind, "push", lambda self, launched, settle=False:
                        push(self, launched, True))
    eager = Run()
    train(monkeypatch, tmp_path / "eager", eager, ["train.epochs=2"])
    assert between_launches(eager.timeline, 2) == ["read 2", READ]  # the wait it saves
    assert run.events == eager.events  # the same records, one per step, in order


@pytest.mark.parametrize("bad", [3, 4])
def test_a_nan_step_read_late_is_never_checkpointed_nor_applied(
        bad: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Step ``bad``'s targets hold a NaN, checkpoints every 2 steps.  Step 3 is read
    after step 4 is launched; step 4 is read at once, before its checkpoint.  Either way
    the run stops there with the checkpoint of step 2 the newest, and the parameters and
    slots are those from before the NaN step: neither it nor a step after it applied."""
    run = Run()
    with pytest.raises(NonFiniteError, match=f"the loss of step {bad} "):
        train(monkeypatch, tmp_path, run, ["train.checkpoint_every_steps=2"], bad=bad - 1)
    assert [step for step, _ in list_checkpoints(checkpoint_dir(tmp_path))] == [2]
    assert run.timeline.index("launch 4") < run.timeline.index(f"read {bad}")
    assert "launch 5" not in run.timeline
    before, after = run.params[bad - 1], run.params[-1]
    assert before.keys() == after.keys()
    for name, array in before.items():
        np.testing.assert_array_equal(after[name], array, err_msg=name)


def test_a_stop_read_late_stops_at_the_next_step_with_its_checkpoint(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A signal before step 3: step 3's stop vote is read after step 4 is launched,
    which is then read at once and checkpointed; the run ends there, every step read."""
    run = Run()
    summary = train(monkeypatch, tmp_path, run, stop=2)
    assert summary["stop_reason"] == "interrupted" and summary["step"] == 4
    assert [step for step, _ in list_checkpoints(checkpoint_dir(tmp_path))] == [4]
    assert steps_recorded(run) == [1, 2, 3, 4]
    assert "launch 5" not in run.timeline
    assert run.timeline.index("launch 4") < run.timeline.index("read 3") \
        < run.timeline.index("read 4")


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_the_late_read_on_a_spatial_layout(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """D2 over the staging transport: inside a step only the transport's stream
    synchronisations, between launching step k and step k + 1 only the read of step
    k - 1, on both ranks; the records are the eager read's on every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = tmp_path / "late" if comm.Get_rank() == 0 else None
    run = Run()
    train(monkeypatch, comm.bcast(out), run, ["parallel.depth=2", "parallel.sample=1"],
          comm=comm)
    timeline = run.timeline
    for k in range(1, STEPS + 1):
        inside = timeline[timeline.index(f"launch {k}") + 1:timeline.index(f"launched {k}")]
        assert inside and all(s.startswith(TRANSPORT) for s in inside), (k, inside)
    for k in range(2, STEPS):
        assert between_launches(timeline, k) == [f"read {k - 1}", READ], k
    push = OneBehind.push
    monkeypatch.setattr(OneBehind, "push", lambda self, launched, settle=False:
                        push(self, launched, True))
    eager = Run()
    train(monkeypatch, comm.bcast(tmp_path / "eager" if out else None), eager,
          ["parallel.depth=2", "parallel.sample=1"], comm=comm)
    assert run.events == eager.events and steps_recorded(run) == list(range(1, STEPS + 1))
