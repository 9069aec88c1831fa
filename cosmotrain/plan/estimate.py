"""A machine model of this CPU node from a quick probe, so planning works before calibrating.

``cosmotrain calibrate`` times every layer key of a config at every level of ranks per
node and every collective (minutes); a new user running ``cosmotrain plan`` or ``parallel:
auto`` first should not need that.  A :class:`Probe` is what ``study/estimate.py``
measures in a few seconds on one process: the engine's own convolutions, activations,
poolings, batch norm and a linear layer on CosmoFlow's first blocks, once with every core's
threads and once with one, plus the per-element times of the optimizer, the input
transform and a copy.  :func:`estimated_machine` turns it into a :class:`MachineModel`
with ``source = "estimate"`` and no per-key curves, so the cost model prices every layer
by its kind's rate (``cost.kernel_seconds``'s fallback):

- convolutions and linear layers at the FLOP rate of the probe's (a blend of a thin first
  layer and two thicker ones, as CosmoFlow's first blocks weigh them; a layer much
  thinner or thicker than those runs slower or faster than priced);
- every other layer at its kind's seconds per element (activations without a probe of
  their own, e.g. dropout, at LeakyReLU's);
- ``k`` ranks on the node: each gets ``cores / k`` threads, so its slowdown is
  ``k ** e`` with ``cores ** e`` the probe's speedup of every core over one thread
  (no bandwidth sharing beyond that: the real calibration measures it);
- messages inside the node: ``ALPHA_INTRA`` per call and a multiple of the probed copy's
  seconds per byte per kind (``INTRA_COPIES``: shared-memory MPI copies each byte in and
  out, channel collectives also reorder it; the ratios are the 2-rank fits of the
  calibrated 2-core development machine, docs/perf/dev-2core.json); between nodes an
  assumed 25 Gb/s network (``INTER_ALPHA``, ``INTER_BYTES_PER_S``), never measured here;
- no overlap of communication with computation (MPICH's default progress).

These are documented assumptions on top of a few measured rates (docs/PLANNING.md); a
command that uses such a model says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cosmotrain.plan.machine import Fit, LinkModel, MachineModel
from cosmotrain.plan.presets import GROUP_SIZES, ring_link

ALPHA_INTRA = 20e-6  # s per message inside a node (the dev VM measured 14-80 us)
INTRA_COPIES = {"p2p": 3.0, "allreduce": 6.0, "allgather": 12.0, "reduce_scatter": 12.0,
                "alltoall": 4.0}
INTER_ALPHA = 30e-6  # s per message between nodes: a 25 Gb/s Ethernet-class network
INTER_BYTES_PER_S = 25e9 / 8 * 0.8
MEASURED_KINDS = ("LeakyReLU", "Pool3d", "BatchNorm3d")
LIKE_ACTIVATION = ("Dropout", "ReLU", "ScaledTanh", "GlobalAvgPool")


@dataclass(frozen=True)
class Probe:
    """What the quick probe measured on one process (rates of a lone rank using every
    core's threads, as the trainer gives a rank alone on its node)."""

    cpu: str  # the processor's name, which with ``cores`` names the estimate
    cores: int
    memory_gib: float
    conv_flop_rate: float  # FLOP/s of forward + backward
    linear_flop_rate: float
    element_time: dict[str, float] = field(default_factory=dict)  # kind -> s per element
    thread_speedup: float = 1.0  # one thread's time over every core's (>= 1)

    @property
    def name(self) -> str:
        return estimate_name(self.cpu, self.cores)


def estimate_name(cpu: str, cores: int) -> str:
    """The estimate's name: a cached estimate is reused only on the same processor and
    core count (a home directory shared by different nodes measures each kind once)."""
    return f"estimate of {cpu or 'this CPU'} x {cores} cores"


def estimated_machine(probe: Probe) -> MachineModel:
    """The machine model of ``probe`` (see the module docstring for every assumption)."""
    copy = probe.element_time.get("copy", 0.0) / 4.0  # s per byte
    elements = dict(probe.element_time)
    for kind in LIKE_ACTIVATION:
        elements.setdefault(kind, elements.get("LeakyReLU", 0.0))
    elements.setdefault("Flatten", probe.element_time.get("copy", 0.0))
    return MachineModel(
        name=probe.name, cores_per_node=probe.cores,
        flop_rate={"Conv3d": probe.conv_flop_rate, "Linear": probe.linear_flop_rate},
        element_time=elements, concurrency=thread_concurrency(probe.cores,
                                                              probe.thread_speedup),
        intra=intra_links(copy), inter=ring_link(INTER_ALPHA, INTER_BYTES_PER_S),
        overlap=0.0, memory_per_node_gib=probe.memory_gib, source="estimate",
        notes=(f"quick estimate: conv {probe.conv_flop_rate / 1e9:.1f} GFLOP/s, "
               f"{probe.thread_speedup:.2f}x from {probe.cores} threads over 1, copy "
               f"{1 / copy / 1e9 if copy else 0:.1f} GB/s; links assumed (docs/PLANNING.md); "
               f"run cosmotrain calibrate for a measured model"))


def thread_concurrency(cores: int, speedup: float) -> dict[int, float]:
    """``concurrency(k)`` for ``k`` = 1, 2, 4, ... and ``cores`` ranks: ``k ** e`` with
    ``cores ** e = speedup`` (each rank has ``cores / k`` threads, a thread's worth
    ``e`` of a perfect one); beyond ``cores`` the model's own rule (proportional)."""
    if cores <= 1:
        return {1: 1.0}
    exponent = math.log(max(speedup, 1.0)) / math.log(cores)
    levels = {1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores}
    return {k: max(1.0, float(k) ** exponent) for k in sorted(levels)}


def intra_links(copy_s_per_byte: float) -> LinkModel:
    """Shared-memory messages: ``ALPHA_INTRA`` per call (a tree's ``log2 p`` calls, an
    all-to-all's ``p - 1``) and ``INTRA_COPIES[kind]`` copies of every byte."""
    collectives = {
        kind: {p: Fit(ALPHA_INTRA * ((p - 1) if kind == "alltoall" else math.log2(p)),
                      INTRA_COPIES[kind] * copy_s_per_byte) for p in GROUP_SIZES}
        for kind in ("allreduce", "allgather", "reduce_scatter", "alltoall")}
    return LinkModel(Fit(ALPHA_INTRA, INTRA_COPIES["p2p"] * copy_s_per_byte), collectives)
