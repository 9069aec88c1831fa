"""Predicted step time of a :class:`~cosmotrain.plan.workload.Workload` on a machine.

The busiest rank's step is the sum of its phases, named as in ``metrics.jsonl``:

- ``compute``: each layer's forward + backward as calibrated with as many ranks busy on
  the node as the strategy puts there (:func:`layer_seconds`; threads speed a lone rank
  up, oversubscription and shared bandwidth slow each of several down);
- ``halo``: point-to-point ``alpha * messages + beta * bytes`` per layer, less the share the
  machine overlaps with the interior computation;
- ``channel``: the all-gathers and reduce-scatters of channel/filter parallel layers;
- ``redistribution``: ToSamples' all-to-all;
- ``allreduce``: gradient buckets per reduction group (less the overlapped share) and
  batch-norm statistics;
- ``other``: the optimizer update of the parameters this rank holds and the input
  transform.

Communication inside a node uses the intra-node constants, between nodes the inter-node
ones (a communicator is taken as intra-node when it fits in ``ranks_per_node``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cosmotrain.config.layout import Layout
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.workload import LayerWork, Transfer, Workload

PHASES = ("compute", "halo", "channel", "redistribution", "allreduce", "other")
PHASE_OF = {"halo": "halo", "allgather": "channel", "reduce_scatter": "channel",
            "alltoall": "redistribution", "allreduce": "allreduce",
            "bn_allreduce": "allreduce"}
OVERLAPPED = {"halo", "allreduce"}
BYTES = 4  # float32 activations and gradients


@dataclass
class Prediction:
    """Predicted seconds per phase of one step, and what follows from them."""

    strategy: Layout
    batch: int
    seconds: dict[str, float]
    memory_bytes: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_s if self.step_s > 0 else 0.0

    @property
    def comm_share(self) -> float:
        """Share of the step spent communicating."""
        comm = sum(v for k, v in self.seconds.items() if k not in ("compute", "other"))
        return comm / self.step_s if self.step_s > 0 else 0.0


def layer_key(layer: LayerWork) -> str:
    """The calibration key: kind and the channels the local kernel sees."""
    if layer.kind == "Conv3d":
        return (f"Conv3d:{layer.in_shape[1]}x{layer.out_shape[1]}:"
                f"k{layer.kernel[0]}s{layer.stride[0]}:{'dx' if layer.input_grad else 'nodx'}")
    if layer.kind == "Linear":
        return f"Linear:{math.prod(layer.in_shape[1:])}x{layer.out_shape[1]}"
    return layer.kind


def shape_key(layer: LayerWork) -> str:
    """The calibration key of ``layer`` at its exact local input shape."""
    return f"{layer_key(layer)}@{'x'.join(map(str, layer.in_shape))}"


def layer_elements(layer: LayerWork) -> float:
    """The size a layer's cost grows with: a convolution's or linear layer's output, the
    larger of input and output for the others (a pooling's input is 8x its output)."""
    if layer.kind in ("Conv3d", "Linear"):
        return float(math.prod(layer.out_shape))
    return float(max(math.prod(layer.out_shape), math.prod(layer.in_shape)))


def layer_seconds(layer: LayerWork, machine: MachineModel, ranks_on_node: int = 1) -> float:
    """Forward + backward of one layer with ``ranks_on_node`` ranks busy on the node.

    The layer's own shape, if calibrated, else its key's curve.  A spatially split
    convolution also pays for the way it overlaps its halo exchange: the forward share of
    its extra kernel calls over one call (a recomputed shell, or interior and shell apart,
    each call paying its own fixed cost: priced on the curve) and the copies of its halo
    handling."""
    elements = layer_elements(layer)
    if elements == 0:
        return 0.0
    seconds = kernel_seconds(layer, elements, machine, ranks_on_node, shape_key(layer))
    if layer.forward_calls:
        total = layer.forward_flops + layer.backward_flops
        share = layer.forward_flops / total if total else 0.0
        calls = sum(kernel_seconds(layer, n, machine, ranks_on_node)
                    for n in layer.forward_calls)
        seconds += share * (calls - kernel_seconds(layer, elements, machine, ranks_on_node))
    if layer.copied:
        seconds += (machine.slowdown(ranks_on_node) * layer.copied *
                    machine.element_time.get("copy", 0.0))
    return max(seconds, 0.0)


def kernel_seconds(layer: LayerWork, elements: float, machine: MachineModel,
                   ranks_on_node: int, shape: str | None = None) -> float:
    """One forward + backward kernel pass of ``layer``'s key at ``elements`` output elements:
    the calibrated ``shape`` or curve of its key, else the kind's one-rank rate times the
    slowdown."""
    measured = machine.layer_time(layer_key(layer), elements, ranks_on_node, shape)
    if measured is not None:
        return measured
    slow = machine.slowdown(ranks_on_node)
    scale = elements / layer_elements(layer)
    flops = layer.forward_flops + layer.backward_flops
    if flops and layer.kind in machine.flop_rate:
        return slow * scale * flops / machine.flop_rate[layer.kind]
    return slow * machine.element_time.get(layer.kind, 0.0) * elements


def transfer_seconds(transfer: Transfer, machine: MachineModel, ranks_per_node: int) -> float:
    """alpha-beta cost of one transfer on the busiest rank."""
    link = machine.link(ranks_per_node, transfer.group)
    nbytes = transfer.elements * BYTES
    if transfer.kind == "halo":
        return transfer.calls * link.p2p.a + nbytes * link.p2p.b if nbytes else 0.0
    return link.collective(transfer.kind, transfer.group, nbytes, transfer.calls,
                           ranks_per_node)


def predict(work: Workload, machine: MachineModel, ranks_per_node: int | None = None
            ) -> Prediction:
    """Seconds per phase of ``work``'s step on ``machine``."""
    per_node = min(work.ranks, ranks_per_node or machine.cores_per_node)
    slow = machine.slowdown(per_node)
    seconds = dict.fromkeys(PHASES, 0.0)
    seconds["compute"] = sum(layer_seconds(layer, machine, per_node) for layer in work.layers)
    for transfer in work.transfers():
        phase = PHASE_OF[transfer.kind]
        cost = transfer_seconds(transfer, machine, per_node)
        if phase in OVERLAPPED and transfer.kind != "bn_allreduce":
            cost *= 1.0 - machine.overlap
        seconds[phase] += cost
    seconds["other"] = slow * (
        machine.element_time.get("optimizer", 0.0) * work.state_held +
        machine.element_time.get("input", 0.0) * work.input_elements)
    return Prediction(work.strategy, work.batch, seconds)
