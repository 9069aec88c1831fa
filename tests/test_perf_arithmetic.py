"""FLOP and memory arithmetic against REFERENCE.md's derived figures."""

from __future__ import annotations

import pytest

from cosmotrain.config.schema import ModelConfig
from cosmotrain.models import build_model
from cosmotrain.plan.flops import layer_costs, training_flops
from cosmotrain.plan.memory import training_memory


def test_cosmoflow_flops_at_128() -> None:
    model = build_model(ModelConfig(name="cosmoflow", width=128), seed=0)
    forward, total = training_flops(model, (1, 4, 128, 128, 128))
    assert forward / 1e9 == pytest.approx(18.5, abs=0.05)
    assert total / 1e9 == pytest.approx(55.6, abs=0.1)
    costs = {c.name: c.forward_flops for c in layer_costs(model, (1, 4, 128, 128, 128))}
    assert (costs["conv1"] + costs["conv2"]) / forward == pytest.approx(0.78, abs=0.01)


def test_mlperf_forward_flops_at_128() -> None:
    model = build_model(ModelConfig(name="cosmoflow-mlperf", width=128), seed=0)
    forward, _ = training_flops(model, (1, 4, 128, 128, 128))
    assert forward / 1e9 == pytest.approx(68.9, abs=0.1)


@pytest.mark.parametrize("width, factor", [(256, 8), (512, 64)])
def test_cosmoflow_flops_scale_with_volume(width: int, factor: int) -> None:
    small = training_flops(build_model(ModelConfig(name="cosmoflow", width=128), seed=0),
                           (1, 4, 128, 128, 128))[0]
    big = training_flops(build_model(ModelConfig(name="cosmoflow", width=width), seed=0),
                         (1, 4, width, width, width))[0]
    assert big / small == pytest.approx(factor, rel=0.02)


def test_step_memory_counts_saved_activations() -> None:
    model = build_model(ModelConfig(name="cosmoflow", width=128), seed=0)
    memory = training_memory(model, (1, 4, 128, 128, 128))
    # conv1's output (16 x 128^3 floats, kept by the in-place LeakyReLU) dominates
    assert memory.saved > 16 * 128**3 * 4
    assert memory.grads == 9_437_636 * 4
