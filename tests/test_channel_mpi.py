"""The invariant under channel/filter parallelism: every algorithm equals one process.

One 8-rank launch (harness: ``equivalence.py``).  cosmoflow and resnet3d, batch norm on
and off, with stationary-x, -y, -w and auto, alone (C2, F2, C2F2, C8, C2F4) and combined
with sample and spatial splits (N2C2, D2C2, D2H2F2): predictions, losses, every gradient,
the running statistics and the parameters after 3 SGD steps match the one-process run
(1e-4 relative, float32), and Adam (sharded optimizer state) in float64 (1e-7).

Each run is also inspected:

* weights: the group's blocks of every split convolution partition its weight (each
  element on exactly one rank of the group), so a rank stores 1/G of them;
* communication: the elements each convolution moved in its all-gathers and
  reduce-scatters, summed over the group, equal ``G * comm_volume`` of the formula
  (halo term aside), per step;
* algorithms: the one each convolution ran is the one asked for (or auto's choice).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort_on_error
from equivalence import (STEPS, adam64_failures, broadcast_refs, everyone_failures,
                         make_config, ranks_of, run_waves)

from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.layers.channel_conv import ChannelConv3d
from cosmotrain.tensor.channel_split import comm_volume

RTOL = 1e-4
MODELS = {
    "cosmoflow": ["model.name=cosmoflow", "model.width=18"],
    "cosmoflow-bn": ["model.name=cosmoflow", "model.width=18", "model.batchnorm=true"],
    "resnet3d": ["model.name=resnet3d", "model.width=12", "model.depth=10",
                 "model.base_channels=4", "model.batchnorm=false"],
    "resnet3d-bn": ["model.name=resnet3d", "model.width=12", "model.depth=10",
                    "model.base_channels=4"],
}
C2F2 = ["parallel.channel=2", "parallel.filter=2"]
STRATEGIES = {
    "C2 x": ["parallel.channel=2", "parallel.channel_algorithm=x"],
    "F2 y": ["parallel.filter=2", "parallel.channel_algorithm=y"],
    "C2F2 w": C2F2 + ["parallel.channel_algorithm=w"],
    "C2F2 auto": C2F2,
    "N2C2": ["parallel.sample=2", "parallel.channel=2"],
    "D2C2 w": ["parallel.depth=2", "parallel.channel=2", "parallel.channel_algorithm=w"],
    "D2H2F2": ["parallel.depth=2", "parallel.height=2", "parallel.filter=2"],
}
EXTRA = [  # more ranks than input channels (empty blocks); per-layer overrides
    ("cosmoflow-bn", "C8 x", ["parallel.channel=8", "parallel.channel_algorithm=x"]),
    ("resnet3d-bn", "C2F4 w, conv1 y, layer2.0.conv1 w 4x2",
     ["parallel.channel=2", "parallel.filter=4", "parallel.channel_algorithm=w",
      "parallel.layers={conv1: {algorithm: y}, layer2.0.conv1: {channel: 4}}"]),
]
ADAM64 = [("cosmoflow-bn", "C2F2 w"), ("resnet3d", "D2C2 w")]


def inspect(step) -> dict:
    """Per convolution: algorithm, weight elements and moved elements summed over the
    group, the full weight size and the formula's volume per rank."""
    group = step.model.grid.group_comms["channel_filter"]
    found = {}
    for name, layer in step.model.spatial.named_layers():
        if isinstance(layer, ChannelConv3d):
            moved = sum(layer.volume.values()) / STEPS
            elements = layer.params["weight"].data.size
            sums = group.allreduce(np.array([moved, elements], np.float64))
            found[name] = dict(algorithm=layer.algorithm, moved=sums[0], elements=sums[1],
                               full=layer.params["weight"].shard.global_shape,
                               expected=_expected(layer, group.size))
    return found


def _expected(layer: ChannelConv3d, group: int) -> float:
    """``G * comm_volume`` without halos, for the layer's last input and output blocks."""
    per_in, per_out = layer.elements_per_channel
    return group * comm_volume(layer.in_channels, layer.out_channels, per_in, per_out, 0.0,
                               layer.blocks.factor, input_grad=layer.needs_input_grad)


def asked_algorithm(cfg, name: str) -> str:
    """The algorithm the config asks of a convolution (auto: not checked here)."""
    override = cfg.parallel.layers.get(name)
    if override is not None and override.algorithm:
        return override.algorithm
    return cfg.parallel.channel_algorithm


def check(case, run) -> list[str]:
    bad = []
    cfg = case[2]
    for name, info in run["inspect"].items():
        asked = asked_algorithm(cfg, name)
        if asked != "auto" and info["algorithm"] != asked:
            bad.append(f"{name}: ran {info['algorithm']}, asked {asked}")
        if info["elements"] != np.prod(info["full"]):
            bad.append(f"{name}: the group holds {info['elements']} weight elements of "
                       f"{np.prod(info['full'])}")
        if not np.isclose(info["moved"], info["expected"], rtol=1e-9):
            bad.append(f"{name}: moved {info['moved']} elements, formula {info['expected']}")
    if not run["inspect"]:
        bad.append("no convolution ran channel/filter parallel")
    return bad


@pytest.mark.parallel(nprocs=8)
@abort_on_error
def test_channel_filter_training_matches_one_process() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _parallel.set_num_workers(1)
    configs = {m: make_config(MODELS[m]) for m in MODELS}
    cases = [(ranks_of(over), f"{model} {name}", make_config(MODELS[model], over), model)
             for model in MODELS for name, over in STRATEGIES.items()]
    cases += [(ranks_of(over), f"{model} {name}", make_config(MODELS[model], over), model)
              for model, name, over in EXTRA]
    failures = run_waves(world, cases, broadcast_refs(world, configs, np.float32),
                         np.float32, RTOL, inspect, check)
    failures += adam64_failures(world, MODELS, STRATEGIES, ADAM64, inspect, check)
    failures = everyone_failures(world, failures)
    assert not failures, f"{len(failures)} mismatches: {failures[:20]}"
