"""Calibration of layer times inside whole steps (``perf/layer_timing.py``) and the
model's use of them: exact shapes before curves, the slowest rank's step split over its
layers, the outer-dimension-first representative of spatial permutations."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from cosmotrain.config import load_config
from cosmotrain.plan.cost import layer_elements, layer_key, layer_seconds, shape_key
from cosmotrain.plan.machine import Curve, MachineModel
from cosmotrain.plan.planner import candidates
from cosmotrain.config.layout import Layout as Strategy
from cosmotrain.plan.workload import build_workload
from cosmotrain.study import layer_timing
from cosmotrain.study.calibrate import _channel_block, candidate_workloads
from cosmotrain.study.layer_timing import (StepTimer, capped, layer_curves, level_sequences,
                                           make_layer, slowest_step_shares, timed_sequence)

CFG = load_config(None, ["model.width=32", "train.batch_size=4"])


def test_shares_add_up_to_the_slowest_rank_step() -> None:
    mean = np.array([[1.0, 2.0, 1.0], [0.0, 0.0, 0.0]])
    shares = slowest_step_shares(mean, np.array([6.0, 0.0]))
    assert shares[0] == pytest.approx([1.5, 3.0, 1.5])  # in proportion to the means
    assert shares[1] == pytest.approx([0.0, 0.0, 0.0])  # nothing timed: nothing divided


def test_levels_run_the_steps_of_their_jobs_once_each() -> None:
    works = candidate_workloads(CFG, 2)
    one, two = level_sequences(works, 1), level_sequences(works, 2)
    assert len(one) == len(works) and len(two) == len(works) - 1  # N1 only at k = 1
    first = build_workload(CFG, Strategy(1))  # a single node's own step comes first
    assert [shape_key(layer) for layer in one[0]] == \
        [shape_key(layer) for layer in first.layers if math.prod(layer.out_shape)]
    assert all(min(layer.in_shape[0] for layer in seq) >= 1 for seq in one + two)
    distinct = {tuple(shape_key(layer) for layer in seq) for seq in one}
    assert len(distinct) == len(one)


def test_large_steps_run_on_fewer_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    layers = tuple(build_workload(CFG, Strategy(1)).layers)
    largest = max(map(layer_elements, layers))
    monkeypatch.setattr(layer_timing, "MAX_ELEMENTS", largest // 3)
    small = capped(layers)
    assert [layer.in_shape[0] for layer in small] == [1] * len(layers)  # 4 -> 2 -> 1
    assert [layer.in_shape[1:] for layer in small] == [layer.in_shape[1:] for layer in layers]


def test_curves_and_shapes_from_the_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = []

    fused = []

    def fake(sequence, cfg, comm, k, cores, repeats, fuse=True):  # 1 ns per element
        runs.append(sequence)
        fused.append(fuse)
        return np.array([layer_elements(layer) * 1e-9 for layer in sequence])

    monkeypatch.setattr(layer_timing, "timed_sequence", fake)
    works = candidate_workloads(CFG, 2)
    curves, shapes = layer_curves(works, CFG, None, 2, 2, 1, lambda _: None)
    wanted = {shape_key(layer) for seq in level_sequences(works, 2) for layer in seq}
    assert wanted <= set(shapes)
    steps, extra = runs[:-1], runs[-1]  # the last run: the shrunk single-size keys
    assert all(shapes[shape_key(layer)] == pytest.approx(layer_elements(layer) * 1e-9)
               for seq in steps for layer in seq)
    assert not {shape_key(layer) for layer in extra} & set(shapes)  # no step's shapes
    assert fused == [True] * len(steps) + [False]  # unrelated shrunk layers: unfused
    assert len(steps) <= len(level_sequences(works, 2))  # covered steps are skipped
    assert all(len(curve.points) >= 2 for curve in curves.values())  # shrunk second points
    conv = next(layer for seq in runs for layer in seq if layer.kind == "Conv3d")
    assert curves[layer_key(conv)](layer_elements(conv)) == pytest.approx(
        layer_elements(conv) * 1e-9)


def test_step_timer_times_every_layer_on_fresh_copies() -> None:
    sequence = tuple(layer for layer in build_workload(CFG, Strategy(1)).layers
                     if math.prod(layer.out_shape))
    step = StepTimer([make_layer(layer, CFG) for layer in sequence], sequence)
    before = [x.copy() for x in step.inputs]
    seconds = step.run(lambda: None, 1)
    assert seconds.shape == (len(sequence),) and (seconds > 0).all()
    assert all(np.array_equal(a, b) for a, b in zip(before, step.inputs))  # not in place
    assert all(p.grad is None for engine in step.engines for p in engine.params.values())
    single = timed_sequence(sequence[:2], CFG, MPI.COMM_SELF, 1, 1, 1)
    assert single.shape == (2,) and (single > 0).all()


def called_backwards(engines: list) -> list[str]:
    """Wraps each engine's backward; the list fills with the names of those that run."""
    ran: list[str] = []
    for engine in engines:
        def backward(dy, ctx, engine=engine, inner=engine.backward):
            ran.append(engine.name)
            return inner(dy, ctx)
        engine.backward = backward
    return ran


@pytest.mark.parametrize("model, handed", [
    ("cosmoflow", {f"act{i}" for i in range(1, 6)}),  # to conv1, to the avg poolings
    ("cosmoflow-mlperf", set()),  # conv -> max pool -> act: nothing to hand over
])
def test_the_step_timer_fuses_as_training_does(model: str, handed: set[str]) -> None:
    """Sample parallel (every layer serial): the same activations are applied in the
    convolutions and the same backwards handed to a neighbour as in a Sequential step."""
    from cosmotrain.nn.containers import Sequential
    from cosmotrain.nn.module import Context

    cfg = load_config(None, [f"model.name={model}", "model.width=32", "train.batch_size=2"])
    sequence = tuple(layer for layer in build_workload(cfg, Strategy(1)).layers
                     if math.prod(layer.out_shape))
    timer = StepTimer([make_layer(layer, cfg) for layer in sequence], sequence)
    timed = called_backwards(timer.engines)
    timer.run(lambda: None, 1)
    engines = [make_layer(layer, cfg) for layer in sequence]
    stepped = called_backwards(engines)
    net = Sequential(name="net", items=engines)
    ctx = Context(training=True, step=1, seed=0)
    x = np.random.default_rng(0).standard_normal(sequence[0].in_shape, dtype=np.float32)
    net.backward(np.ones_like(net.forward(x, ctx)), ctx)
    assert timed == stepped and "fc1" in timed
    assert {layer.name for layer in sequence} - set(timed) == handed
    unfused = StepTimer([make_layer(layer, cfg) for layer in sequence], sequence, fuse=False)
    alone = called_backwards(unfused.engines)
    unfused.run(lambda: None, 1)
    assert "act1" in alone and len(alone) == len(sequence)


def test_block_layers_fuse_as_the_distributed_layers_do() -> None:
    """On blocks a pooling takes no activation and a channel convolution none; the two
    parts are separate sequences."""
    from cosmotrain.study.layer_timing import _chain_starts

    spatial = build_workload(CFG, Strategy.parse("D2")).layers
    starts = _chain_starts(spatial, True)
    names = [layer.name for layer in spatial]
    pool = names.index("pool1")
    assert starts[pool] == pool and starts[names.index("act1")] == names.index("conv1")
    head = next(i for i, layer in enumerate(spatial) if layer.part != spatial[0].part)
    assert starts[head] == head
    channel = build_workload(CFG, Strategy.parse("C2F2")).layers
    starts = _chain_starts(channel, True)
    act = [layer.name for layer in channel].index("act2")
    assert starts[act] == act  # after a channel convolution: not linked
    assert _chain_starts(spatial, False) == list(range(len(spatial)))


@pytest.mark.parallel(nprocs=2)
def test_a_pass_is_split_by_the_mean_and_scaled_to_the_slowest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = MPI.COMM_WORLD
    rank_times = {0: [1.0, 1.0], 1: [3.0, 1.0]}  # rank 1 is the slow one: 4 s in all

    def run(self, sync, step):
        sync()
        return np.array(rank_times[world.Get_rank()])

    monkeypatch.setattr(StepTimer, "run", run)
    sequence = tuple(build_workload(CFG, Strategy(1)).layers[:2])
    seconds = timed_sequence(sequence, CFG, world, 2, 2, 3)
    assert seconds == pytest.approx([4.0 * 2 / 3, 4.0 * 1 / 3])  # means 2 : 1, sum 4
    alone = timed_sequence(sequence, CFG, world, 1, 2, 3)  # rank 1 idle: rank 0 alone
    assert alone == pytest.approx([1.0, 1.0])


def test_exact_shapes_before_curves_and_the_extra_calls_on_the_curve() -> None:
    work = build_workload(CFG, Strategy(1, depth=2))
    conv = next(layer for layer in work.layers if layer.forward_calls)
    elements = layer_elements(conv)
    curve = Curve([(elements / 4, 0.25), (elements, 1.0)])
    machine = MachineModel("m", 2, layers={2: {layer_key(conv): curve}})
    on_curve = layer_seconds(conv, machine, 2)
    machine.shapes[2] = {shape_key(conv): 3.0}
    exact = layer_seconds(conv, machine, 2)
    assert exact == pytest.approx(on_curve - 1.0 + 3.0)  # the calls' extra cost kept
    assert layer_seconds(conv, machine, 1) == pytest.approx(on_curve)  # other level: curve
    again = MachineModel.from_json(machine.to_json())
    assert again.shapes == machine.shapes and again.layers[2][layer_key(conv)] == curve


def test_spatial_permutations_keep_the_outer_dimensions_split() -> None:
    _, strategies = candidates(CFG, 4)
    names = {s.describe() for s in strategies}
    assert {"D4", "D2H2", "N2D2"} <= names
    assert not any(s.width > 1 and s.height < s.width for s in strategies)
    assert not names & {"W4", "H4", "H2W2", "D2W2", "N2W2", "N2H2"}


@pytest.mark.parametrize("group", [2, 4])
def test_channel_collectives_are_timed_on_layer_shaped_blocks(group: int) -> None:
    count = 1 << 20
    n, c, run, *rest = _channel_block(count, group)
    assert (n, c, rest) == (2, 2, [1, 1]) and run > 1000  # whole voxel rows per channel
    assert n * c * run * (group - 1) == pytest.approx(count, rel=1e-3)
