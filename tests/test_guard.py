"""The stop-signal recorder and the finiteness checks behind the trainer's guard, and the
guards' votes (``engine/votes.py``): a new guard's field is summed over the ranks with the
loss."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import abort_on_error
from equivalence import batch_data, batch_loss, make_config

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.errors import JobStopped
from cosmotrain.device.xp import all_finite as gradients_finite
from cosmotrain.engine.step import hybrid_step_from_config
from cosmotrain.engine.votes import Votes
from cosmotrain.models import build_model
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.train.stops import StopSignals, non_finite_message


def test_the_first_stop_signal_is_recorded_and_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as signals:
        assert not signals.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a later, different signal changes nothing
        assert signals.received == signal.SIGUSR1 and signals.name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_second_ctrl_c_stops_at_once_past_any_except_exception() -> None:
    """JobStopped is no Exception (nor a KeyboardInterrupt, which Typer would turn into a
    plain exit before the CLI could abort the other ranks)."""
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.name == "SIGINT"
        with pytest.raises(JobStopped) as info:
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except Exception:  # noqa: BLE001 - what library code on the way might do
                pytest.fail("a second Ctrl-C was caught as an Exception")
    assert info.value.exit_code == 130 and not isinstance(info.value, KeyboardInterrupt)
    assert "interrupted again" in str(info.value)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_during_start_up_a_signal_stops_at_once_and_after_defer_it_is_recorded(
        signum: int) -> None:
    with StopSignals(at_once=True) as signals:
        with pytest.raises(JobStopped) as info:
            os.kill(os.getpid(), signum)
        assert info.value.exit_code == 75 and signals.received == signum
        assert f"{signal.Signals(signum).name} received during start-up" in str(info.value)
    with StopSignals(at_once=True) as signals:
        signals.defer()
        os.kill(os.getpid(), signum)
        assert signals.received == signum  # recorded: the loop stops at a step boundary


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_element_is_found(bad: float) -> None:
    grads = [np.ones((3, 4), np.float32), np.zeros(5, np.float32), None]
    assert gradients_finite(grads)
    grads[1][2] = bad
    assert not gradients_finite(grads)


def test_a_large_finite_gradient_is_not_mistaken_for_inf() -> None:
    huge = np.full(1000, 3e38, np.float32)  # its float32 sum overflows
    with np.errstate(over="ignore"):
        assert math.isinf(float(huge.sum(dtype=np.float32)))
    assert gradients_finite([huge])


def test_device_sums_are_added_on_the_device_and_read_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU route, numpy standing in for cupy: every per-array sum is a 'device'
    scalar, stacked and read in one go instead of one wait per parameter."""
    from types import SimpleNamespace

    from cosmotrain.device import xp

    stacked: list[int] = []

    def stack(values: list) -> np.ndarray:
        stacked.append(len(values))
        return np.stack(values)
    cupy = SimpleNamespace(stack=stack, ndarray=SimpleNamespace)  # holds no array
    monkeypatch.setattr(xp, "_loaded_cupy", lambda: cupy)
    monkeypatch.setattr(xp, "is_device_array", lambda a: isinstance(a, np.generic))
    grads = [np.ones((3, 4), np.float32), None, np.full(1000, 3e38, np.float32),
             np.zeros(5, np.float32)]
    assert gradients_finite(grads) and stacked == [3]
    grads[3][1] = np.nan
    assert not gradients_finite(grads) and stacked == [3, 3]


def test_the_message_names_the_step_and_what_went_non_finite() -> None:
    line = non_finite_message(7, float("nan"), 2)
    assert "gradients of step 6 on 2 rank(s)" in line and "loss of step 7 (nan)" in line
    assert "\n" not in line and "--resume" in line


@dataclass(frozen=True)
class MoreVotes(Votes):
    """A new guard: one more field, nothing else."""

    flagged: int = 0


def test_votes_travel_as_doubles_in_field_order_and_come_back_typed() -> None:
    mine = MoreVotes(stop=1, flagged=1)
    assert mine.values() == (1.0, 0.0, 1.0)
    assert mine.summed([2.0, 1.0, 3.0]) == MoreVotes(stop=2, bad_gradients=1, flagged=3)
    with pytest.raises(ValueError, match="2 sums for the 3 votes"):
        mine.summed([1.0, 2.0])


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_a_new_guard_vote_is_summed_over_the_ranks_with_the_loss() -> None:
    """A step on two ranks (N2): each rank's votes of a new guard come back summed, the
    same on both ranks, and the loss they rode with is the one process's loss."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = make_config(["model.name=tiny", "model.width=8"], ["parallel.sample=2"])
    grid = ProcessGrid(world, resolve_parallel(cfg, world.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    x, targets = batch_data(cfg, np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    ctx = Context(step=0, seed=cfg.train.seed)
    out = step.gradients(DistTensor.scatter(x, dist, coord), targets, ctx,
                         votes=MoreVotes(stop=int(world.rank == 1), flagged=world.rank + 1))
    grid.free()
    model = build_model(cfg.model, cfg.train.seed)
    serial, _ = batch_loss(model.forward(x.copy(), ctx), targets, targets.size)
    verdicts = world.allgather((out.votes, out.loss))
    assert [v[0] for v in verdicts] == [MoreVotes(stop=1, bad_gradients=0, flagged=3)] * 2
    assert all(abs(loss - serial) <= 1e-5 * abs(serial) for _, loss in verdicts)
