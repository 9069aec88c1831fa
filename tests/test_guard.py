"""The stop-signal recorder and the finiteness checks behind the trainer's guard."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest

from cosmotrain.errors import JobStopped
from cosmotrain.device.xp import all_finite as gradients_finite
from cosmotrain.train.guard import StopSignals, non_finite_message


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
