"""What the busiest rank computes and moves in one training step, from shapes alone.

The cost model prices a :class:`Workload`; this module builds it with the engine's own
planning functions, never a re-derivation: where spatial parallelism stops
(:func:`~cosmotrain.layers.hybrid.spatial_stop`), each convolution's channel/filter
algorithm (:func:`~cosmotrain.layers.channel_plan.plan_channels`), the weight blocks
(:class:`~cosmotrain.tensor.channel_split.ChannelBlocks`) and the halo margins of every
rank (:func:`~cosmotrain.tensor.windows.window_halos`).  So the volumes here are what the
code sends, which ``tests/test_perf_model.py`` checks against the counters of a real run.

Imports, one way only (``layers/`` never imports ``plan/``): the pure geometry comes from
``tensor/`` (channel blocks, interior/shell plans and ``REDO_SHELL_MAX``, halo margins);
two decisions come from ``layers/`` because the engine takes them on the serial layer
classes when it builds the hybrid model and the workload must take the same ones:
``layers.hybrid.spatial_stop`` and ``layers.channel_plan.plan_channels`` (with its
``LayerChoice``).  Both are pure (no MPI) and ``layers.hybrid`` loads no MPI at import.

Per layer, shapes are the local kernel's (the busiest rank's block: ``ceil`` of every
split), and each :class:`Transfer` gives the busiest rank's elements (``elements``, what
sets the step time) and the job's total (``total``, what the counters sum to).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from cosmotrain.config.layout import Layout
from cosmotrain.config.schema import Config
from cosmotrain.layers.channel_plan import LayerChoice, plan_channels
from cosmotrain.layers.hybrid import spatial_stop
from cosmotrain.models import build_model
from cosmotrain.nn.containers import Sequential
from cosmotrain.nn.layers import BatchNorm3d, Conv3d, Pool3d
from cosmotrain.nn.module import Layer
from cosmotrain.plan.flops import LayerCost, layer_costs
from cosmotrain.tensor.boxes import box_shape
from cosmotrain.tensor.channel_split import ChannelBlocks, Factor, fine_block
from cosmotrain.tensor.distribution import block_range
from cosmotrain.tensor.interior import REDO_SHELL_MAX, conv_dim, overlap_plan
from cosmotrain.tensor.windows import WindowHalo, halo_plans, window_halos

BLOCKS, SAMPLES = "blocks", "samples"
ADAM_SLOTS = {"adam": 2, "sgd": 1}  # optimizer state arrays per parameter


@dataclass(frozen=True)
class Transfer:
    """One kind of communication of one layer (or of the step), forward + backward.

    ``elements``: what the busiest rank receives (halo, all-gather, all-to-all) or hands to
    the collective (reduce-scatter, allreduce); ``total``: summed over every rank of the
    job; ``group``: ranks in the communicator; ``calls``: messages posted by the busiest rank
    (halo) or collective calls (the others), each paying the latency once.
    """

    kind: str
    group: int
    elements: float
    total: float
    calls: int


@dataclass(frozen=True)
class LayerWork:
    """One leaf layer on the busiest rank: local kernel shapes and communication."""

    name: str
    kind: str
    part: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    input_grad: bool
    kernel: tuple[int, ...] = (1, 1, 1)
    transfers: tuple[Transfer, ...] = ()
    stride: tuple[int, ...] = (1, 1, 1)
    forward_calls: tuple[float, ...] = ()  # spatial conv: output elements of each kernel call
    copied: float = 0.0  # spatial conv / pool: elements its halo handling copies (fwd + bwd)
    mode: str = ""  # a pooling's: "avg" or "max" (the calibrator times the model's own)

    @property
    def forward_flops(self) -> float:
        if self.kind == "Conv3d":
            return 2.0 * math.prod(self.out_shape) * self.in_shape[1] * math.prod(self.kernel)
        if self.kind == "Linear":
            return 2.0 * self.in_shape[0] * math.prod(self.in_shape[1:]) * self.out_shape[1]
        return 0.0

    @property
    def backward_flops(self) -> float:
        """Weight gradient always, input gradient unless the layer is the first."""
        return self.forward_flops * (2.0 if self.input_grad else 1.0)


@dataclass
class Workload:
    """A step of ``strategy`` on the busiest rank (see the module docstring)."""

    strategy: Layout
    batch: int
    width: int
    layers: list[LayerWork]
    stop: str
    redistribution: list[Transfer] = field(default_factory=list)
    reductions: list[Transfer] = field(default_factory=list)
    params_held: int = 0
    params_total: int = 0
    optimizer_slots: int = 2
    state_held: int = 0  # elements of each optimizer slot held (params_held unless sharded)
    input_elements: int = 0

    @property
    def ranks(self) -> int:
        return self.strategy.size

    def transfers(self) -> list[Transfer]:
        """Every transfer of the step: layers', redistribution, gradient reductions."""
        return [t for layer in self.layers for t in layer.transfers] + \
            self.redistribution + self.reductions

    def volume(self, kind: str) -> float:
        """Elements of one kind of transfer summed over the job."""
        return sum(t.total for t in self.transfers() if t.kind == kind)


def build_workload(cfg: Config, strategy: Layout, model: Sequential | None = None
                   ) -> Workload:
    """The busiest rank's step of ``cfg``'s model and batch under ``strategy``."""
    model = model if model is not None else build_model(cfg.model, cfg.train.seed)
    width, batch = cfg.model.width, cfg.train.batch_size
    shape = (batch, cfg.model.channels, width, width, width)
    stop = spatial_stop(model, shape, strategy.spatial, strategy.spatial_until, strategy.group)
    grid = Factor(strategy.channel, strategy.filter)
    choices = plan_channels(model.items[:stop], shape, grid, strategy.spatial,
                            strategy.sample, strategy.channel_algorithm, {}) \
        if strategy.group > 1 else {}
    layers_by_name = dict(model.named_layers())
    block_part = Sequential(name=model.name, items=model.items[:stop])
    builder = _Builder(strategy, choices, cfg.parallel.bn_statistics)
    layers = [builder.block_layer(cost, layers_by_name[cost.name], first=i == 0)
              for i, cost in enumerate(layer_costs(block_part, shape))]
    head_in = block_part.output_shape(shape) if stop else shape
    head = Sequential(name=model.name, items=model.items[stop:])
    head_batch = _head_batch(batch, strategy)
    layers += [builder.head_layer(cost, layers_by_name[cost.name], head_batch,
                                  first=stop == 0 and i == 0)
               for i, cost in enumerate(layer_costs(head, (batch,) + head_in[1:]))]
    work = Workload(strategy, batch, width, layers, model.items[stop].name
                    if stop < len(model.items) else "",
                    optimizer_slots=ADAM_SLOTS.get(cfg.optimizer.name, 0),
                    input_elements=_ceil_div(batch, strategy.sample) * _fine(
                        cfg.model.channels, strategy.group) * _block_volume(shape, strategy))
    work.redistribution = _to_samples(head_in, strategy) if stop else []
    _add_parameters(work, model, stop, strategy, cfg.parallel.bucket_mb,
                    cfg.parallel.shard_optimizer)
    return work


@dataclass
class _Builder:
    strategy: Layout
    choices: dict[str, LayerChoice]
    bn_statistics: str

    def block_layer(self, cost: LayerCost, layer: Layer, first: bool) -> LayerWork:
        """A layer on spatial (and channel) blocks: local shapes, halos, collectives."""
        s = self.strategy
        samples = _ceil_div(cost.in_shape[0], s.sample)
        spatial_in = _blocks(cost.in_shape[2:], s.spatial)
        spatial_out = _blocks(cost.out_shape[2:], s.spatial)
        channels_in, channels_out = (_fine(cost.in_shape[1], s.group),
                                     _fine(cost.out_shape[1], s.group))
        transfers: list[Transfer] = []
        lead_total = cost.in_shape[0] * cost.in_shape[1]  # every sample and channel once
        if isinstance(layer, Conv3d) and s.group > 1:
            channels_in, channels_out, transfers, lead_total = self._channel_conv(
                cost, layer, samples, spatial_in, spatial_out, first)
        calls: tuple[float, ...] = ()
        copied = 0.0
        if isinstance(layer, (Conv3d, Pool3d)) and any(w > 1 for w in s.spatial):
            per_dim = _window_halos(cost.in_shape, layer, s)
            transfers.append(_halo(per_dim, samples * channels_in, lead_total,
                                   backward=not first))
            if isinstance(layer, Conv3d):
                calls, copied = _spatial_conv_calls(per_dim, layer, samples * channels_in,
                                                    samples * channels_out)
            else:
                copied = _spatial_pool_copies(per_dim, samples * channels_in)
        if isinstance(layer, BatchNorm3d):
            group = s.size // s.group if self.bn_statistics == "global" else \
                s.size // (s.group * s.sample)
            transfers.append(_allreduce(group, 4 * channels_in, s.size, calls=2,
                                        kind="bn_allreduce"))
        return LayerWork(cost.name, cost.kind, BLOCKS,
                         (samples, channels_in, *spatial_in),
                         (samples, channels_out, *spatial_out), not first,
                         _kernel(layer), tuple(transfers), _stride(layer), calls, copied,
                         getattr(layer, "mode", ""))

    def head_layer(self, cost: LayerCost, layer: Layer, samples: int, first: bool
                   ) -> LayerWork:
        """A layer on whole local samples (data parallel over every rank)."""
        transfers = []
        if isinstance(layer, BatchNorm3d):
            group = self.strategy.size if self.bn_statistics == "global" else \
                self.strategy.size // self.strategy.sample
            transfers.append(_allreduce(group, 4 * cost.in_shape[1], self.strategy.size,
                                        calls=2, kind="bn_allreduce"))
        return LayerWork(cost.name, cost.kind, SAMPLES, (samples,) + cost.in_shape[1:],
                         (samples,) + cost.out_shape[1:], not first, _kernel(layer),
                         tuple(transfers), _stride(layer), mode=getattr(layer, "mode", ""))

    def _channel_conv(self, cost: LayerCost, layer: Conv3d, samples: int,
                      spatial_in: tuple[int, ...], spatial_out: tuple[int, ...], first: bool
                      ) -> tuple[int, int, list[Transfer], float]:
        """Gathered input channels, computed filters, the collectives of a split conv and
        the samples x channels its halos carry, summed over the job."""
        s, choice = self.strategy, self.choices[cost.name]
        g, c, f = s.group, choice.factor.channel, choice.factor.filter
        cin, cout = layer.in_channels, layer.out_channels
        blocks = [ChannelBlocks(cin, cout, choice.factor, r) for r in range(g)]
        gathered = [b.input_channels()[1] - b.input_channels()[0] for b in blocks]
        rows = [len(b.filter_rows()) for b in blocks]
        own_in = [_length(fine_block(cin, g, r)) for r in range(g)]
        own_out = [_length(fine_block(cout, g, r)) for r in range(g)]
        x_elems = samples * math.prod(spatial_in)
        y_elems = samples * math.prod(spatial_out)
        replicas = s.size // g
        gather = [(a - o) * x_elems for a, o in zip(gathered, own_in)]
        scatter = [(r - o) * y_elems for r, o in zip(rows, own_out)]
        both = 1 if first else 2  # reduce-scatter of dL/dx unless the first layer
        transfers = []
        if f > 1:
            transfers.append(Transfer("allgather", f, both * max(gather),
                                      both * sum(gather) * replicas, both))
        if c > 1:
            transfers.append(Transfer("reduce_scatter", c, 2 * max(scatter),
                                      2 * sum(scatter) * replicas, 2))
        return max(gathered), max(rows), transfers, cost.in_shape[0] * sum(gathered)


def _to_samples(shape: tuple[int, ...], s: Layout) -> list[Transfer]:
    """ToSamples' all-to-all in each sample group (forward and backward)."""
    ranks = s.size // s.sample
    if ranks == 1:
        return []
    group_samples = _ceil_div(shape[0], s.sample)
    per_rank = group_samples * _fine(shape[1], s.group) * _block_volume(shape, s)
    moved = per_rank * (ranks - 1) / ranks
    return [Transfer("alltoall", ranks, 2 * moved, 2 * moved * s.size, 2)]


def _add_parameters(work: Workload, model: Sequential, stop: int, s: Layout,
                    bucket_mb: float, shard: bool = False) -> None:
    """Parameters held per rank and the gradient allreduces (bucketed, per group).

    ``shard`` (``parallel.shard_optimizer``): each rank keeps the optimizer state of 1/R
    of a group's parameters; its reduce-scatter and all-gather move what the allreduce
    moves, so the transfers are priced as one allreduce."""
    block_params = sum(p.data.size for item in model.items[:stop]
                       for _, p in item.named_parameters())
    head_params = sum(p.data.size for item in model.items[stop:]
                      for _, p in item.named_parameters())
    split = s.group > 1
    held_blocks = math.ceil(block_params / s.group) if split else block_params
    work.params_held = held_blocks + head_params
    work.params_total = block_params + head_params
    bucket = max(bucket_mb * 2**20 / 4, 1.0)
    # (ranks per reduction group, elements the busiest rank holds, elements over the job)
    groups = [(s.size // s.group, held_blocks, block_params * (s.size // s.group)),
              (s.size, head_params, head_params * s.size)] if split else \
        [(s.size, block_params + head_params, (block_params + head_params) * s.size)]
    work.state_held = sum(math.ceil(elements / ranks) if shard else elements
                          for ranks, elements, _ in groups)
    for ranks, elements, total in groups:
        if ranks > 1 and elements:
            calls = max(1, math.ceil(elements / bucket))
            work.reductions.append(Transfer("allreduce", ranks, elements, total, calls))


def _allreduce(group: int, elements: float, job: int, calls: int, kind: str = "allreduce"
               ) -> Transfer:
    return Transfer(kind, group, elements, elements * job if group > 1 else 0, calls)


def _window_halos(in_shape: tuple[int, ...], layer: Layer, s: Layout
                  ) -> list[list[WindowHalo]]:
    """Every rank position's window halo along D, H and W of a window layer's input."""
    return [window_halos(size, ways, k, st, tuple(p)) for size, ways, k, st, p in
            zip(in_shape[2:], s.spatial, layer.kernel, layer.stride, layer.padding)]


def _halo(per_dim: list[list[WindowHalo]], lead: int, lead_total: float, backward: bool
          ) -> Transfer:
    """Halo elements of a convolution / pooling input: margins in, margin gradients back.

    ``lead``: samples x channels of the busiest rank's block; ``lead_total``: the same
    summed over the ranks sharing a spatial block position."""
    counts = [_rank_halo_counts(coord_halos, per_dim) for coord_halos in
              itertools.product(*[range(len(h)) for h in per_dim])]
    scale = 2 if backward else 1
    worst = max(counts, key=lambda c: c[0])
    total = sum(c[0] for c in counts) * lead_total
    return Transfer("halo", 2, scale * lead * worst[0], scale * total, scale * worst[1])


def _spatial_conv_calls(per_dim: list[list[WindowHalo]], layer: Conv3d, lead_in: int,
                        lead_out: int) -> tuple[tuple[float, ...], float]:
    """The forward kernel calls of a spatially split convolution on its busiest rank (output
    elements of each, as ``SpatialConv3d`` makes them: one call over the whole output plus
    the recomputed shell, or the interior and the shell apart) and the input elements its
    halo handling copies: the block into the halo buffer (forward), the extended block
    rebuilt for the weight gradient and the margin gradients sent back (backward)."""
    plans = [halo_plans(halos) for halos in per_dim]
    worst: tuple[tuple[float, ...], float] = ((), 0.0)
    for coord in itertools.product(*[range(len(h)) for h in per_dim]):
        dims = tuple(conv_dim(per_dim[d][c], plans[d][c], layer.kernel[d], layer.stride[d])
                     for d, c in enumerate(coord))
        out = math.prod(d.out_len for d in dims)
        if not out:
            continue
        plan = overlap_plan(dims)
        shell = [math.prod(box_shape(sub.out)) for sub in plan.shell]
        if plan.interior is None:
            calls = [out]
        elif plan.shell_fraction <= REDO_SHELL_MAX:
            calls = [out] + shell
        else:
            calls = [math.prod(box_shape(plan.interior.out))] + shell
        extended = math.prod(d.ext_len for d in dims)
        candidate = (tuple(float(lead_out * n) for n in calls), 3.0 * lead_in * extended)
        if (sum(candidate[0]), len(candidate[0])) > (sum(worst[0]), len(worst[0])):
            worst = candidate
    return worst


def _spatial_pool_copies(per_dim: list[list[WindowHalo]], lead_in: int) -> float:
    """Input elements a spatially split pooling copies on its busiest rank: its extended
    block, rebuilt from the block and the received planes (forward, ``restore_extended``,
    slab by slab when large), unless it receives and crops nothing (the kernel reads the
    block itself); backward writes the extended gradient into the buffer it sends from."""
    rebuilt = [math.prod(h.in_range[1] - h.in_range[0] for h in halos)
               for halos in itertools.product(*per_dim)
               if any(h.halo_lo or h.halo_hi for h in halos)]
    return float(lead_in * max(rebuilt, default=0))


def _rank_halo_counts(coord: tuple[int, ...], per_dim: list[list[WindowHalo]]
                      ) -> tuple[float, int]:
    """(elements received per unit of leading dims, messages) of the rank at ``coord``."""
    halos = [dim[i] for dim, i in zip(per_dim, coord)]
    owned = [h.owned for h in halos]
    grown = [h.recv_lo + h.owned + h.recv_hi for h in halos]
    received = math.prod(grown) - math.prod(owned)
    messages = 0
    for offset in itertools.product((-1, 0, 1), repeat=3):
        if offset == (0, 0, 0):
            continue
        extents = [{-1: h.recv_lo, 0: h.owned, 1: h.recv_hi}[o] for h, o in zip(halos, offset)]
        if all(extents):
            messages += 1
    return float(received), messages


def _head_batch(batch: int, s: Layout) -> int:
    """Samples the busiest rank holds after ToSamples (a group's over its ranks)."""
    group_samples = _ceil_div(batch, s.sample)
    return _ceil_div(group_samples, s.size // s.sample)


def _blocks(sizes: tuple[int, ...], ways: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_length(block_range(n, w, 0)) for n, w in zip(sizes, ways))


def _block_volume(shape: tuple[int, ...], s: Layout) -> int:
    return math.prod(_blocks(shape[2:], s.spatial))


def _fine(channels: int, group: int) -> int:
    """The largest fine channel block of ``channels`` over ``group`` ranks."""
    return _length(fine_block(channels, group, 0))


def _kernel(layer: Layer) -> tuple[int, ...]:
    return tuple(getattr(layer, "kernel", (1, 1, 1)))


def _stride(layer: Layer) -> tuple[int, ...]:
    return tuple(getattr(layer, "stride", (1, 1, 1)))


def _length(block: tuple[int, int]) -> int:
    return block[1] - block[0]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

