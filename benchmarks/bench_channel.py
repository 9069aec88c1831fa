"""Channel/filter parallelism: weight memory, communication volume, allreduce volume.

    mpiexec -n P python benchmarks/bench_channel.py [--config FILE] [--set KEY=VALUE ...]
        [--steps N] [--threads T]

Runs ``--steps`` Adam steps of the configured model and strategy (each rank builds
only its input block, as ``bench_hybrid.py``) and prints one JSON object (rank 0):

* ``memory``: per rank, the bytes of the split layers' weights and their Adam state
  (``exp_avg``, ``exp_avg_sq``) against the same layers' full weights and state, the
  1/P target being ``1 / G`` (G = channel x filter ranks), and the total parameter +
  state bytes;
* ``layers``: for every channel/filter convolution, its algorithm and the elements one
  rank moved per step, counted (all-gathers received + reduce-scatters sent, halos
  received) and from ``channel_split.comm_volume`` (the same terms, group average);
* ``allreduce``: the gradient elements each rank handed to allreduces per step and the
  seconds spent in them, to compare with pure sample parallelism on the same ranks
  (run with ``--set parallel.sample=P``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__import__("cosmotrain")  # before numpy: sets OpenBLAS's idle spin (cosmotrain/__init__.py)
import numpy as np
from bench_hybrid import run_steps, setup, targets
from mpi4py import MPI

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.layers.channel_conv import ChannelConv3d
from cosmotrain.tensor.channel_split import comm_volume, halo_elements
from cosmotrain.engine.step import HybridStep


def state_arrays(step: HybridStep, name: str) -> list[Any]:
    """The optimizer's per-element state arrays of parameter ``name`` (Adam: two)."""
    return [v for v in step.optimizer.state.get(name, {}).values() if np.ndim(v)]


def memory(step: HybridStep) -> dict:
    """Split-layer weights + optimizer state held by this rank, against their full size."""
    params = dict(step.model.named_parameters())
    held = full = total = 0
    for name, param in params.items():
        arrays = [param.data, *state_arrays(step, name)]
        mine = sum(a.nbytes for a in arrays)
        total += mine
        if param.shard is not None:
            held += mine
            full += len(arrays) * int(np.prod(param.shard.global_shape)) * param.data.itemsize
    return {"split_held_mib": held / 2**20, "split_full_mib": full / 2**20,
            "total_held_mib": total / 2**20}


def layer_volumes(step: HybridStep, steps: int, batch: int) -> dict:
    """Per channel/filter convolution: counted and predicted elements per rank per step."""
    grid = step.model.grid
    group = grid.group_comms["channel_filter"]
    found = {}
    for name, layer in step.model.spatial.named_layers():
        if not isinstance(layer, ChannelConv3d):
            continue
        halo = sum(geo.exchange.received for geo in layer.inner._cache.values()) \
            if layer.inner is not None else 0
        counted = np.array([sum(layer.volume.values()), halo], np.float64) / steps
        counted = group.allreduce(counted) / group.size  # the group's average
        found[name] = {"algorithm": layer.algorithm, "factor": [layer.blocks.factor.channel,
                                                              layer.blocks.factor.filter],
                       "collectives_counted": counted[0], "halo_counted": counted[1],
                       **predicted(layer, grid, batch)}
    return found


def predicted(layer: ChannelConv3d, grid: ProcessGrid, batch: int) -> dict:
    """The formula's collective and halo terms for this layer (group average)."""
    per_in, per_out = layer.elements_per_channel
    factor, grad = layer.blocks.factor, layer.needs_input_grad
    collectives = comm_volume(layer.in_channels, layer.out_channels, per_in, per_out, 0.0,
                              factor, grad)
    samples = batch / grid.ways("sample")
    halo_per_channel = samples * halo_elements(_input_block(layer), layer.kernel,
                                               grid.spatial_shape)
    halo = comm_volume(layer.in_channels, layer.out_channels, 0.0, 0.0, halo_per_channel,
                       factor, grad)
    return {"collectives_formula": collectives, "halo_formula": halo}


def _input_block(layer: ChannelConv3d) -> list[float]:
    """The mean spatial input block of the layer (of its last input distribution)."""
    if layer.inner is None or not layer.inner._cache:
        return [0.0, 0.0, 0.0]
    dist = next(iter(layer.inner._cache))
    return [size / ways for size, ways in zip(dist.global_shape[2:], dist.grid[2:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    cfg, step, x = setup(world, args)
    grid, width, batch = step.grid, cfg.model.width, cfg.train.batch_size
    records = run_steps(step, x, targets(batch, cfg.model.outputs), args.steps, False)
    result: dict[str, Any] = {
        "strategy": grid.layout.describe(), "ranks": world.Get_size(), "width": width,
        "batch": batch, "memory_per_rank": world.gather(memory(step), root=0),
        "layers": layer_volumes(step, args.steps, batch),
        "allreduce_elements_per_step": world.gather(step.reducer.volume / args.steps, root=0),
        "allreduce_seconds_per_step": world.gather(
            float(np.mean([r["allreduce"] for r in records])), root=0),
        "seconds_per_step": world.allreduce(min(r["seconds"] for r in records), op=MPI.MAX)}
    if world.rank == 0:
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
