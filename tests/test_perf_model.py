"""The performance model's arithmetic: FLOPs, parameters, volumes, strategies, costs.

FLOP and parameter counts must equal REFERENCE.md's published or derived figures, and
the halo, channel-collective and gradient-allreduce volumes must equal what the engine
really sends, counted in a 4-rank run (``test_volumes_equal_what_a_run_sends``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cosmotrain.config import load_config
from cosmotrain.errors import UserError
from cosmotrain.plan.cost import layer_key, predict
from cosmotrain.plan.machine import Curve, Fit, LinkModel, MachineModel
from cosmotrain.plan.planner import plan
from cosmotrain.train.auto_layout import load_machine
from cosmotrain.plan.presets import PRESETS
from cosmotrain.config.layout import Layout as Strategy, parse_layout as parse_strategy
from cosmotrain.plan.strategy import enumerate_strategies, factorisations
from cosmotrain.plan.workload import build_workload


def config(*sets: str):
    return load_config(None, list(sets))


@pytest.mark.parametrize("name,params,gflop", [
    ("cosmoflow", 9_437_636, 18.5), ("cosmoflow-mlperf", 8.91e6, 68.9)])
def test_flops_and_parameters_equal_the_reference(name: str, params: float, gflop: float
                                                  ) -> None:
    work = build_workload(config(f"model.name={name}", "model.width=128",
                                 "train.batch_size=1"), Strategy(1))
    forward = sum(layer.forward_flops for layer in work.layers)
    assert round(forward / 1e9, 1) == gflop
    if name == "cosmoflow":
        assert work.params_total == params
        backward = sum(layer.backward_flops for layer in work.layers)
        conv1 = work.layers[0].forward_flops  # the first layer computes no dL/dx
        assert round((forward + backward + conv1) / 1e9, 1) == 55.6  # REFERENCE: 3 x fwd
    else:  # REFERENCE.md gives 8.91 M
        assert round(work.params_total / 1e6, 2) == params / 1e6


def test_busiest_rank_shares_the_work() -> None:
    cfg = config("model.width=64", "train.batch_size=8")
    one = build_workload(cfg, Strategy(1))
    total = sum(layer.forward_flops for layer in one.layers)
    for strategy in (Strategy(4), Strategy(1, depth=2, height=2),
                     Strategy(1, 2, 2, channel_algorithm="w"), Strategy(2, filter=2,
                                                                       channel_algorithm="y")):
        work = build_workload(cfg, strategy)
        spatial = sum(layer.forward_flops for layer in work.layers if layer.part == "blocks")
        head = sum(layer.forward_flops for layer in work.layers if layer.part == "samples")
        assert spatial + head == pytest.approx(total / 4, rel=0.02), strategy.describe()
    channel = build_workload(cfg, Strategy(1, 2, 2, channel_algorithm="w"))
    assert channel.params_held < one.params_held / 2  # blocks of the split convolutions


def test_strategy_names_round_trip_and_enumeration_is_complete() -> None:
    for text in ("N1", "N2D2", "C2F2:w", "F4:y", "D2H2@pool4", "N2C2:x"):
        assert parse_strategy(text).describe() == text
    with pytest.raises(UserError, match="not understood"):
        parse_strategy("X2")
    assert sorted(factorisations(4, 2)) == [(1, 4), (2, 2), (4, 1)]
    found = {s.describe() for s in enumerate_strategies(4, 4, 64, 16)}
    assert {"N4", "D4", "N2D2", "C4:x", "F4:y", "C2F2:w", "D2H2", "N2C2:x"} <= found
    assert "C2F2:x" not in found and "N3" not in found
    assert not any(s.sample == 4 for s in enumerate_strategies(4, 2, 64, 16))  # batch 2


def test_costs_add_up_and_follow_the_machine() -> None:
    machine = MachineModel("test", 4, flop_rate={"Conv3d": 1e9, "Linear": 1e9},
                           element_time={"LeakyReLU": 1e-9, "copy": 1e-10},
                           intra=LinkModel(Fit(1e-5, 1e-9)))
    cfg = config("model.width=32", "train.batch_size=4")
    work = build_workload(cfg, Strategy(1, depth=2))
    prediction = predict(work, machine, 2)
    flops = sum(layer.forward_flops + layer.backward_flops for layer in work.layers
                if layer.kind in ("Conv3d", "Linear"))
    relus = sum(math.prod(layer.out_shape) for layer in work.layers
                if layer.kind == "LeakyReLU")
    split = [layer for layer in work.layers if layer.forward_calls]
    assert split and all(layer.copied > 0 for layer in split)
    overlap = sum(layer.forward_flops / 1e9 *  # the forward's extra calls, and the copies
                  (sum(layer.forward_calls) / math.prod(layer.out_shape) - 1) +
                  layer.copied * 1e-10 for layer in split)
    pools = [layer for layer in work.layers if layer.kind == "Pool3d"]
    assert pools and all(layer.copied == math.prod(layer.in_shape[:2]) *  # rebuilt
                         (layer.in_shape[2] + 1) * math.prod(layer.in_shape[3:])
                         for layer in pools[:1])  # pool1: its block and one received plane
    overlap += sum(layer.copied * 1e-10 for layer in pools)
    assert overlap > 0
    assert prediction.seconds["compute"] == pytest.approx(flops / 1e9 + relus * 1e-9 +
                                                          overlap)
    halo = [t for layer in work.layers for t in layer.transfers if t.kind == "halo"]
    assert prediction.seconds["halo"] == pytest.approx(
        sum(t.calls * 1e-5 + 4 * t.elements * 1e-9 for t in halo))
    work = build_workload(cfg, Strategy(2))  # no spatial split: one call per layer
    prediction = predict(work, machine, 2)
    conv1 = work.layers[0]
    elements = math.prod(conv1.out_shape)
    machine.layers[1] = {layer_key(conv1): Curve([(elements / 2, 0.5), (elements * 2, 2.0)])}
    assert predict(work, machine, 1).seconds["compute"] == pytest.approx(  # curve wins
        prediction.seconds["compute"] - (conv1.forward_flops + conv1.backward_flops) / 1e9
        + 1.0)  # interpolated between its points
    machine.concurrency = {1: 1.0, 2: 2.0}
    doubled = predict(work, machine, 2).seconds["compute"]
    assert doubled == pytest.approx(2 * predict(work, machine, 1).seconds["compute"])
    machine.layers[2] = {layer_key(conv1): Curve([(elements, 1.25)])}  # measured at k=2
    assert predict(work, machine, 2).seconds["compute"] == pytest.approx(
        doubled - 2 * 1.0 + 1.25)


def test_curves_interpolate_and_extrapolate() -> None:
    curve = Curve([(40, 3.0), (10, 1.0), (20, 1.5)])
    assert [curve(x) for x in (10, 15, 30)] == pytest.approx([1.0, 1.25, 2.25])
    assert curve(5) == pytest.approx(0.75)  # below: the line through the two smallest
    assert curve(80) == pytest.approx(6.0)  # above: the largest point's rate
    assert Curve([(10, 1.0), (20, 5.0)])(1) == 0.0  # never negative
    with pytest.raises(ValueError):
        Curve([])


def test_plan_ranks_by_predicted_time_and_respects_memory() -> None:
    cfg = config("model.width=128", "train.batch_size=8")
    ranked = plan(cfg, 8, load_machine("h100"))
    steps = [p.prediction.step_s for p in ranked]
    assert steps == sorted(steps) and len(ranked) > 10
    limit = sorted(p.memory_bytes for p in ranked)[len(ranked) // 2]
    assert all(p.memory_bytes <= limit for p in plan(cfg, 8, load_machine("h100"),
                                                     memory_per_rank=limit))
    with pytest.raises(UserError, match="no strategy"):
        plan(cfg, 8, load_machine("h100"), memory_per_rank=1.0)
    assert set(PRESETS) == {"v100-abci", "a100", "h100"}
    v100 = load_machine("v100-abci")  # one GPU per rank: never more than one card's memory
    big = config("model.width=512", "train.batch_size=1")
    with pytest.raises(UserError, match="no strategy for 1 rank"):
        plan(big, 1, v100)  # a 512^3 sample needs about 32 GiB
    assert all(p.memory_bytes <= 0.9 * 16 * 2**30 for p in plan(big, 4, v100))


@pytest.mark.parallel(nprocs=4)
def test_volumes_equal_what_a_run_sends() -> None:
    """Halo, channel and gradient volumes of one step, counted, equal the model's."""
    from mpi4py import MPI

    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.config.layout import resolve_parallel
    from cosmotrain.nn.module import Context
    from cosmotrain.tensor import halo
    from cosmotrain.tensor.dist_tensor import DistTensor
    from cosmotrain.engine.step import hybrid_step_from_config

    comm = MPI.COMM_WORLD
    exchanges: list[halo.HaloExchange] = []
    original = halo.HaloExchange.__post_init__

    def register(self: halo.HaloExchange) -> None:
        original(self)
        exchanges.append(self)

    halo.HaloExchange.__post_init__ = register  # type: ignore[method-assign]
    try:
        for name in ("D2H2", "N2D2", "D4", "C2F2:w", "F4:y", "N2C2:x", "D2F2:y"):
            strategy = parse_strategy(name)
            cfg = config("model.width=32", "train.batch_size=4", "optimizer.name=adam",
                         *strategy.overrides())
            exchanges.clear()
            grid = ProcessGrid(comm, resolve_parallel(cfg, 4))
            step = hybrid_step_from_config(cfg, grid)
            dist, coord = step.model.input_distribution((4, 4, 32, 32, 32))
            x = np.random.default_rng(0).standard_normal(dist.local_shape(coord),
                                                         dtype=np.float32)
            step(DistTensor(x, dist, coord), np.zeros((4, 4), np.float32),
                 Context(step=0, seed=0), 1e-3)
            channel = sum(sum(layer.volume.values()) for _, layer in
                          step.model.spatial.named_layers() if hasattr(layer, "volume"))
            counted = np.array([sum(e.received for e in exchanges), channel,
                                step.reducer.volume], float)
            comm.Allreduce(MPI.IN_PLACE, counted)
            work = build_workload(cfg, strategy)
            modelled = [work.volume("halo"),
                        work.volume("allgather") + work.volume("reduce_scatter"),
                        work.volume("allreduce")]
            np.testing.assert_allclose(counted, modelled, rtol=1e-9, err_msg=name)
            grid.free()
    finally:
        halo.HaloExchange.__post_init__ = original  # type: ignore[method-assign]


def test_collectives_priced_alone_or_beside_other_groups() -> None:
    link = LinkModel(Fit(1e-5, 1e-9), {"allgather": {2: Fit(0.0, 3e-9)}},
                     {"allgather": {2: Fit(0.0, 1e-9)}})
    assert link.collective("allgather", 2, 1e6, 1, ranks_on_node=2) == pytest.approx(1e-3)
    assert link.collective("allgather", 2, 1e6, 1, ranks_on_node=4) == pytest.approx(3e-3)
    assert link.collective("allgather", 2, 1e6, 1) == pytest.approx(3e-3)  # as calibrated
    assert link.collective("allgather", 1, 1e6, 1, ranks_on_node=2) == 0.0
