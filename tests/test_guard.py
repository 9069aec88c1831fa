"""The stop-signal recorder and the finiteness checks behind the trainer's guard."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pytest

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


def test_a_second_ctrl_c_interrupts_at_once() -> None:
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


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
