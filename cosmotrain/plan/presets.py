"""Machine models of GPU clusters from public specifications, for model-only projections.

cosmotrain's GPU backend is not measured yet, so these are *documented assumptions*, not
calibrations (docs/PROJECTION.md has the table and the reasoning).  One rank per GPU, so
ranks never share a device (``concurrency`` is 1); every kernel is priced by an effective
rate: convolutions and linear layers at a share of the GPU's dense peak for the
precision, the other layers as memory-bound traffic (12 bytes per element for forward +
backward) at a share of the HBM bandwidth.  Links: NVLink inside a node, InfiniBand
between nodes.  Collectives pay a tree's latency (``log2 p`` steps of ``alpha``; pairwise
all-to-all ``p - 1``) and their bytes at the link bandwidth; between nodes that is the
node's whole network bandwidth, which hierarchical collectives (NCCL) use.  Memory per
GPU bounds the strategies the planner may choose.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cosmotrain.plan.machine import Fit, LinkModel, MachineModel

GROUP_SIZES = tuple(2 ** i for i in range(1, 13))  # 2 .. 4096 ranks
ELEMENT_BYTES = 12.0  # a memory-bound layer reads and writes about 3 floats per element


def ring_link(alpha: float, bandwidth: float) -> LinkModel:
    """alpha-beta costs of collectives on a link of ``bandwidth`` bytes/s (tree latency).

    A transfer's bytes are what one rank receives (all-gather, all-to-all) or hands in
    (reduce-scatter, allreduce: the whole buffer, which a ring moves ``2 (p-1)/p`` times).
    """
    collectives: dict[str, dict[int, Fit]] = {}
    for kind, factor in (("allreduce", 2.0), ("allgather", 1.0), ("reduce_scatter", 1.0),
                         ("alltoall", 1.0)):
        collectives[kind] = {
            p: Fit(((p - 1) if kind == "alltoall" else factor * math.log2(p)) * alpha,
                   (factor * (p - 1) / p if kind == "allreduce" else 1.0) / bandwidth)
            for p in GROUP_SIZES}
    return LinkModel(Fit(alpha, 1.0 / bandwidth), collectives)


def gpu_cluster(name: str, gpus_per_node: int, dense_flops: float, efficiency: float,
                hbm_bytes_per_s: float, nvlink: float, network: float, gib_per_gpu: float,
                notes: str) -> MachineModel:
    """A cluster of identical GPU nodes (rates in FLOP/s and bytes/s; ``network`` is the
    node's)."""
    element = ELEMENT_BYTES / (0.7 * hbm_bytes_per_s)
    return MachineModel(
        name=name, cores_per_node=gpus_per_node,
        flop_rate={"Conv3d": dense_flops * efficiency, "Linear": dense_flops * efficiency},
        element_time={kind: element for kind in
                      ("Pool3d", "BatchNorm3d", "LeakyReLU", "Dropout", "Flatten", "ReLU",
                       "optimizer", "input")},
        concurrency={k: 1.0 for k in range(1, gpus_per_node + 1)},
        intra=ring_link(10e-6, nvlink), inter=ring_link(5e-6 + 10e-6, network),
        overlap=0.5, memory_per_node_gib=gib_per_gpu * gpus_per_node,
        memory_per_device_gib=gib_per_gpu, notes=notes, source="preset")


def v100_abci() -> MachineModel:
    """ABCI (Oyama et al.'s machine): 4 V100-SXM2 16 GB per node, NVLink 2, 2 x IB EDR."""
    return gpu_cluster("v100-abci", 4, 15.7e12, 0.2, 900e9, 50e9, 2 * 12.5e9 * 0.8, 16,
                       "fp32 (no tensor cores), 3D convolutions at 20% of peak (the paper's "
                       "1.42 PFLOP/s on 512 GPUs is 18%); 2 x 100 Gb/s EDR per node")


def a100_cluster() -> MachineModel:
    """4 x A100-SXM4 40 GB per node (Perlmutter-like), NVLink 3, 4 x 200 Gb/s."""
    return gpu_cluster("a100", 4, 156e12, 0.11, 1555e9, 200e9, 4 * 25e9 * 0.8, 40,
                       "TF32 tensor cores at 11% of dense peak for 3D convolutions (about "
                       "MLPerf HPC v3.0's 80-88 samples/s per A100); one 200 Gb/s NIC per "
                       "GPU")


def h100_cluster() -> MachineModel:
    """4 x H100-SXM5 80 GB per node, NVLink 4, 4 x 400 Gb/s NDR."""
    return gpu_cluster("h100", 4, 989e12, 0.04, 3350e9, 450e9, 4 * 50e9 * 0.8, 80,
                       "bf16 at an effective 40 TFLOP/s for 3D convolutions (the "
                       "MLPerf-level efficiency the GPU issue targets); one 400 Gb/s NIC "
                       "per GPU")


PRESETS: dict[str, Callable[[], MachineModel]] = {
    "v100-abci": v100_abci, "a100": a100_cluster, "h100": h100_cluster}
