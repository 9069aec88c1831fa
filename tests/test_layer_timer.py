"""``cosmotrain.nn.profile.LayerTimer``: per-layer forward/backward times, synchronised
around each call when a device synchronize is given (benchmarks/bench_step.py --layers)."""

from __future__ import annotations

import numpy as np

from cosmotrain.config.load import load_config
from cosmotrain.models import build_model
from cosmotrain.nn.containers import Sequential
from cosmotrain.nn.module import Context
from cosmotrain.nn.profile import LayerTimer


def test_every_computing_leaf_is_timed_both_ways_and_removal_restores() -> None:
    model = build_model(load_config(None, ["model.name=tiny", "model.width=8"]).model, 0)
    calls = []
    timer = LayerTimer(model, Sequential(name="empty", items=[]),
                       sync=lambda: calls.append(1))
    x = np.random.default_rng(0).normal(size=(2, 4, 8, 8, 8)).astype(np.float32)
    y = model.forward(x, Context(step=0))
    model.backward(np.ones_like(y), Context(step=0))
    leaves = [name for name, layer in model.named_layers() if not layer.children()]
    # conv1 (no input gradient) runs act1's backward in its own (nn/containers.py)
    assert {key for key in timer.seconds} == {(n, p) for n in leaves
                                              for p in ("forward", "backward")
                                              } - {("act1", "backward")}
    assert all(seconds > 0 for seconds in timer.seconds.values())
    assert len(calls) == 2 * len(timer.seconds)  # before and after each call
    timer.remove()
    timer.reset()
    synchronised = len(calls)
    model.forward(x, Context(step=1))
    assert not timer.seconds and len(calls) == synchronised
