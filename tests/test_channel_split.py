"""Channel/filter parallelism without MPI: blocks, the volume formula, the plan, shards."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cosmotrain.config.load import load_config
from cosmotrain.errors import ConfigError
from cosmotrain.layers.channel_plan import plan_channels
from cosmotrain.layers.shards import Shard, gather_full
from cosmotrain.models import build_model
from cosmotrain.tensor.channel_split import (ChannelBlocks, Factor, algorithm_factor,
                                             choose_algorithm, comm_volume, fine_block)

SHAPES = [(4, 16), (16, 32), (5, 3), (3, 7), (64, 64)]
FACTORS = [Factor(1, 1), Factor(2, 1), Factor(1, 2), Factor(2, 2), Factor(4, 2), Factor(2, 4),
           Factor(8, 1), Factor(1, 8), Factor(3, 2)]


def _blocks(c_in: int, c_out: int, factor: Factor) -> list[ChannelBlocks]:
    return [ChannelBlocks(c_in, c_out, factor, rank) for rank in range(factor.size)]


@pytest.mark.parametrize("c_in,c_out", SHAPES)
@pytest.mark.parametrize("factor", FACTORS, ids=str)
def test_weight_blocks_partition_the_weight(c_in: int, c_out: int, factor: Factor) -> None:
    """Every weight element sits on exactly one rank of the group."""
    count = np.zeros((c_out, c_in), int)
    for blocks in _blocks(c_in, c_out, factor):
        rows, cols = blocks.weight_index()
        count[np.ix_(rows, np.arange(c_in)[cols])] += 1
    assert (count == 1).all()


@pytest.mark.parametrize("c_in,c_out", SHAPES)
@pytest.mark.parametrize("factor", FACTORS, ids=str)
def test_collectives_meet_the_standard_layout(c_in: int, c_out: int, factor: Factor) -> None:
    """The all-gather over my f ranks yields my weight's channels, in order; the
    reduce-scatter over my c ranks hands each its own fine block of the output."""
    g = factor.size
    for rank, blocks in enumerate(_blocks(c_in, c_out, factor)):
        ic, if_ = factor.position(rank)
        peers = [ic * factor.filter + k for k in range(factor.filter)]  # my filter_comm
        gathered = [fine_block(c_in, g, p) for p in peers]
        assert [b - a for a, b in gathered] == blocks.input_pieces()
        lo, hi = blocks.input_channels()
        assert (gathered[0][0], gathered[-1][1]) == (lo, hi)
        peers = [k * factor.filter + if_ for k in range(factor.channel)]  # my channel_comm
        pieces = [np.arange(*fine_block(c_out, g, p)) for p in peers]
        assert [len(p) for p in pieces] == blocks.output_pieces()
        assert np.array_equal(np.concatenate(pieces), blocks.filter_rows())
        assert blocks.output_block() == fine_block(c_out, g, rank)
        assert peers[ic] == rank  # my piece is my own fine block


def test_the_three_algorithms_are_factorisations() -> None:
    grid = Factor(2, 4)
    assert algorithm_factor("x", grid) == Factor(8, 1)
    assert algorithm_factor("y", grid) == Factor(1, 8)
    assert algorithm_factor("w", grid) == grid
    with pytest.raises(ValueError, match="unknown channel algorithm"):
        algorithm_factor("z", grid)


def test_volume_formula_terms() -> None:
    """x moves only outputs, y only inputs; the first layer skips the dL/dx term."""
    c_in, c_out, s_x, s_y = 16, 32, 1000.0, 1000.0
    grid = Factor(2, 2)
    x = comm_volume(c_in, c_out, s_x, s_y, 0.0, algorithm_factor("x", grid))
    y = comm_volume(c_in, c_out, s_x, s_y, 0.0, algorithm_factor("y", grid))
    w = comm_volume(c_in, c_out, s_x, s_y, 0.0, grid)
    assert x == pytest.approx(2 * 3 * c_out * s_y / 4)
    assert y == pytest.approx(2 * 3 * c_in * s_x / 4)
    assert w == pytest.approx(2 * (c_in * s_x + c_out * s_y) / 4)
    first = comm_volume(c_in, c_out, s_x, s_y, 0.0, algorithm_factor("y", grid),
                        input_grad=False)
    assert first == pytest.approx(y / 2)


def test_choice_follows_the_volumes() -> None:
    grid = Factor(2, 2)
    assert choose_algorithm(4, 16, 1e6, 1e6, 0.0, grid) == "y"  # few channels in: gather x
    assert choose_algorithm(64, 16, 1e6, 1e6, 0.0, grid) == "x"  # few filters: scatter y
    assert choose_algorithm(64, 64, 1e6, 1e6, 0.0, grid) == "w"  # 2D moves least
    assert choose_algorithm(64, 64, 1e6, 1e6, 0.0, Factor(4, 1)) == "x"  # tie: x first
    # halos of the gathered input make gathering dearer
    assert choose_algorithm(16, 18, 1e3, 1e3, 0.0, Factor(1, 4)) == "y"
    assert choose_algorithm(16, 18, 1e3, 1e3, 1e3, Factor(1, 4)) == "x"


def _model(name: str, **extra):
    overrides = [f"model.name={name}", "model.width=32"] + [f"{k}={v}" for k, v in extra.items()]
    cfg = load_config(None, overrides)
    return build_model(cfg.model, 0)


def test_plan_names_every_convolution_and_applies_overrides() -> None:
    model = _model("resnet3d", **{"model.depth": 10, "model.base_channels": 4})
    cfg = load_config(None, ["parallel.layers={conv1: {algorithm: x}, "
                             "layer2.0.conv1: {algorithm: w, channel: 4}}"])
    plan = plan_channels(model.items[:5], (2, 4, 32, 32, 32), Factor(2, 4), (1, 1, 1), 1,
                         "y", cfg.parallel.layers)
    assert "layer1.0.conv2" in plan and "layer2.0.downsample.0" in plan
    assert plan["conv1"].algorithm == "x" and plan["conv1"].factor == Factor(8, 1)
    assert plan["layer2.0.conv1"].factor == Factor(4, 2)
    assert plan["layer1.0.conv1"].factor == Factor(1, 8)


def test_plan_auto_picks_stationary_y_for_cosmoflow() -> None:
    """cosmoflow doubles the channels at every convolution: gathering x is cheaper."""
    model = _model("cosmoflow")
    plan = plan_channels(model.items[:8], (4, 4, 32, 32, 32), Factor(2, 2), (1, 1, 1), 1,
                         "auto", {})
    assert plan and all(choice.algorithm == "y" for choice in plan.values())


def test_plan_rejects_bad_overrides() -> None:
    model = _model("cosmoflow")
    unknown = load_config(None, ["parallel.layers={conv99: {algorithm: x}}"])
    with pytest.raises(ConfigError, match="parallel.layers.conv99"):
        plan_channels(model.items[:4], (4, 4, 32, 32, 32), Factor(2, 2), (1, 1, 1), 1,
                      "auto", unknown.parallel.layers)
    odd = load_config(None, ["parallel.layers={conv1: {algorithm: w, channel: 3}}"])
    with pytest.raises(ConfigError, match="does not divide"):
        plan_channels(model.items[:4], (4, 4, 32, 32, 32), Factor(2, 2), (1, 1, 1), 1,
                      "auto", odd.parallel.layers)


def test_layers_section_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="parallel.layers"):
        load_config(None, ["parallel.layers=conv1"])
    with pytest.raises(ConfigError, match="parallel.layers.conv1.algorithm"):
        load_config(None, ["parallel.layers={conv1: {algorithm: q}}"])


class _OneRank:
    def Get_size(self) -> int:
        return 1


class _Group:
    """A stand-in for a communicator whose ranks' blocks are all known here."""

    def __init__(self, everyone: list) -> None:
        self.everyone = everyone

    def Get_size(self) -> int:
        return len(self.everyone)

    def allgather(self, _mine):
        return self.everyone


def test_shards_take_put_and_gather() -> None:
    rng = np.random.default_rng(0)
    full = rng.normal(size=(7, 5, 3, 3, 3)).astype(np.float32)
    factor = Factor(2, 2)
    per_rank = []
    for blocks in _blocks(5, 7, factor):
        shard = Shard(full.shape, blocks.weight_index())
        per_rank.append([("w", shard.take(full), shard)])
    got = gather_full(_Group(per_rank), per_rank[0] + [("b", np.ones(3), None)])
    assert np.array_equal(got["w"], full) and np.array_equal(got["b"], np.ones(3))
    alone = gather_full(_OneRank(), [("b", np.arange(3.0), None)])
    assert np.array_equal(alone["b"], np.arange(3.0))


def test_factor_positions() -> None:
    factor = Factor(3, 2)
    assert [factor.position(r) for r in range(6)] == list(itertools.product(range(3),
                                                                            range(2)))
    with pytest.raises(ValueError):
        factor.position(6)
