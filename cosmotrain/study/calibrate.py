"""``cosmotrain calibrate``: fit the cost model's constants on this machine.

Run it with as many ranks as a node will run (``mpiexec -n 4 cosmotrain calibrate -c F``):

1. *layers*: for ``k`` = 1, 2, 4, ... and the job size, ranks ``0..k-1`` run at once the
   local layer list of every strategy for ``k`` or more ranks (up to the job) as whole
   training steps, and every layer's forward + backward is timed inside them (each rank
   with the threads the trainer would give it): one
   :class:`~cosmotrain.plan.machine.Curve` per level and key
   (:mod:`cosmotrain.study.layer_timing`).  Timing every level is what makes the model hold
   for data-parallel and spatial steps alike: how much sharing a node slows a layer
   depends on the layer (memory-bound pooling and thin convolutions suffer most), which a
   single node-wide factor cannot express;
2. *concurrency*: per level, the summed time of every measured point over its time on one
   rank, for keys and levels the model has no curve for;
3. *elements*: the optimizer update, the input transform and a fresh copy (halo buffers),
   seconds per element;
4. *links*: point-to-point exchanges between rank pairs and each collective the engine
   uses, on every power-of-two communicator size up to the job, all groups at once (as
   segmented collectives run) and with the first group alone (as a job of that many ranks
   per node runs them), up to the largest message the strategies send:
   ``alpha + beta * bytes`` per kind and size.  Channel all-gathers and reduce-scatters go
   through the engine's own functions, copies to and from channel-major order included.

Everything runs the engine's own layers and MPI calls, so the constants price what
training does.  The result is one JSON file (``MachineModel``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cosmotrain.atomic import previous_name
from cosmotrain.config.schema import Config
from cosmotrain.errors import WriteError
from cosmotrain.kernels import _parallel
from cosmotrain.nn.module import Parameter
from cosmotrain.plan.cost import BYTES, layer_elements, layer_key
from cosmotrain.plan.machine import Curve, Fit, LinkModel, MachineModel
from cosmotrain.plan.planner import REFUSED, candidates
from cosmotrain.plan.workload import LayerWork, Workload, build_workload
from cosmotrain.study.layer_timing import layer_curves, quiet_barrier
from cosmotrain.tensor.channel_collectives import allgather_channels, reduce_scatter_channels
from cosmotrain.train.optim import build_optimizer

MESSAGE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 23)
MAX_MESSAGE_BYTES = 1 << 27  # the largest collective timed (larger ones extrapolate)


@dataclass
class Settings:
    """How long to measure: repetitions per timing and the largest ranks considered."""

    repeats: int = 3
    max_ranks: int = 1


def calibrate(cfg: Config, comm: Any, settings: Settings, log: Callable[[str], None]
              ) -> MachineModel | None:
    """Measure and fit (collective); the model on rank 0, None elsewhere."""
    rank, size = comm.Get_rank(), comm.Get_size()
    cores = os.cpu_count() or 1
    machine = MachineModel(name=os.uname().nodename, cores_per_node=cores,
                           memory_per_node_gib=_node_memory_gib())
    _parallel.set_blas_threads(1)
    works = candidate_workloads(cfg, settings.max_ranks)
    for k in levels(size):
        started = time.perf_counter()
        log(f"layers: every layer key inside whole steps, {k} rank(s) at once")
        machine.layers[k], machine.shapes[k] = layer_curves(works, cfg, comm, k, cores,
                                                            settings.repeats, log)
        log(f"  ({time.perf_counter() - started:.0f} s)")
    machine.concurrency = concurrency_of(machine.layers)
    machine.flop_rate = flop_rates(machine.layers[1], works)
    machine.element_time = _run_alone(comm, lambda: element_times(cfg, settings))
    if size > 1:
        log("links: point-to-point and collectives")
        machine.intra = measure_links(comm, settings, message_sizes(works))
        machine.inter = machine.intra
        machine.notes = (f"calibrated with {size} rank(s) on one node; inter-node links "
                         "copy the intra-node ones (calibrate across nodes to measure them)")
    return machine if rank == 0 else None


def save_keeping_previous(machine: MachineModel, path: Path,
                          now: float | None = None) -> tuple[Path, Path | None]:
    """Write ``machine`` to ``path`` (atomically); a calibration already there is kept
    beside it as ``<name>.previous-<YYYYmmdd-HHMMSS>.json`` (a 64-rank calibration from a
    cluster is not lost to a later one on a laptop).  Returns both paths."""
    path, previous = Path(path), None
    if path.is_file():
        previous = previous_name(path, now)
        try:
            shutil.copy2(path, previous)
        except OSError as err:  # nothing replaced yet: one line, the old file intact
            raise WriteError(previous, err, where="--out") from err
    return machine.save(path), previous


def levels(size: int) -> list[int]:
    """The ranks-per-node counts timed: powers of two up to the job, and the job."""
    return sorted({1 << i for i in range(size.bit_length()) if 1 << i <= size} | {size})


def _node_memory_gib() -> float:
    """Physical memory of this node (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def _run_alone(comm: Any, work: Callable[[], Any]) -> Any:
    """Rank 0 works while the others sleep (not spin) until it is done."""
    result = work() if comm.Get_rank() == 0 else None
    quiet_barrier(comm)
    return result


# --- layers -----------------------------------------------------------------------------

def candidate_workloads(cfg: Config, max_ranks: int) -> list[Workload]:
    """The step of every strategy the planner weighs for 1 to ``max_ranks`` ranks (the
    splits the engine refuses left out): what calibration must be able to price."""
    works = []
    for ranks in range(1, max_ranks + 1):
        model, strategies = candidates(cfg, ranks)
        for strategy in strategies:
            try:
                works.append(build_workload(cfg, strategy, model))
            except REFUSED:
                continue
    return works


def flop_rates(curves: dict[str, Curve], works: list[Workload]) -> dict[str, float]:
    """Median FLOP/s of one rank's convolutions and linear layers (fallback for new keys),
    each key at its largest local size."""
    largest: dict[str, LayerWork] = {}
    for layer in (layer for work in works for layer in work.layers):
        key = layer_key(layer)
        if key not in largest or layer_elements(layer) > layer_elements(largest[key]):
            largest[key] = layer
    rates: dict[str, list[float]] = {}
    for key, layer in largest.items():
        kind = key.split(":")[0]
        if kind not in ("Conv3d", "Linear") or key not in curves or not layer_elements(layer):
            continue
        seconds = curves[key](layer_elements(layer))
        if seconds > 0:
            rates.setdefault(kind, []).append(
                (layer.forward_flops + layer.backward_flops) / seconds)
    return {kind: float(statistics.median(values)) for kind, values in rates.items()}


def element_times(cfg: Config, settings: Settings) -> dict[str, float]:
    """Seconds per element of the optimizer update and of the input transform."""
    count = 1 << 20
    param = Parameter(np.zeros(count, np.float32))
    param.grad = np.full(count, 1e-3, np.float32)
    optimizer = build_optimizer(cfg.optimizer)

    def update() -> None:
        optimizer.step([("p", param)], cfg.optimizer.lr)

    raw = np.random.default_rng(0).integers(0, 8, count).astype(np.int16)
    block = np.ones(16 * count, np.float32)  # halo buffers: far larger than the caches
    return {"optimizer": _median_time(update, settings.repeats) / count,
            "input": _median_time(lambda: np.log1p(raw, dtype=np.float32),
                                  settings.repeats) / count,
            "copy": _median_time(lambda: block.copy(), settings.repeats) / block.size}


def _median_time(work: Callable[[], Any], repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- concurrency ------------------------------------------------------------------------

def concurrency_of(curves: dict[int, dict[str, Curve]]) -> dict[int, float]:
    """Per level, the summed seconds of every measured point over one rank's: how much
    ``k`` busy ranks slow each other on the whole, for what has no curve of its own."""
    base = curves[1]
    result = {}
    for k, keys in curves.items():
        pairs = [(t, base[key](x)) for key, curve in keys.items() if key in base
                 for x, t in curve.points]
        result[k] = sum(t for t, _ in pairs) / max(sum(t1 for _, t1 in pairs), 1e-12)
    return result


# --- links ------------------------------------------------------------------------------

def message_sizes(works: list[Workload]) -> tuple[int, ...]:
    """``MESSAGE_BYTES``, extended by factors of 4 up to the largest single collective of
    ``works`` (capped at ``MAX_MESSAGE_BYTES``): beyond the caches a byte costs more, and
    the 8 MiB-capped fit priced C2:x's channel phase at 0.069 s against 0.202 s measured
    (docs/PERFORMANCE.md)."""
    largest = max([0.0] + [t.elements * BYTES / t.calls for work in works
                           for t in work.transfers() if t.calls])
    sizes = list(MESSAGE_BYTES)
    while sizes[-1] < largest and sizes[-1] * 4 <= MAX_MESSAGE_BYTES:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


def measure_links(comm: Any, settings: Settings,
                  sizes: tuple[int, ...] = MESSAGE_BYTES) -> LinkModel:
    """Point-to-point and collective alpha-beta fits on this job's ranks."""
    size = comm.Get_size()
    p2p = _fit_sizes([(nbytes, _pair_exchange(comm, nbytes, settings.repeats))
                      for nbytes in sizes])
    collectives: dict[str, dict[int, Fit]] = {}
    alone: dict[str, dict[int, Fit]] = {}
    group = 2
    while group <= size:
        rank = comm.Get_rank()
        every = comm.Split(rank // group if rank < size // group * group else size, rank)
        first = comm.Split(0 if rank < group else 1, rank)  # the first group, the rest idle
        for kind in ("allreduce", "allgather", "reduce_scatter", "alltoall"):
            for table, sub in ((collectives, every), (alone, first)):
                if table is alone and group == size:  # one group is every group
                    alone.setdefault(kind, {})[group] = collectives[kind][group]
                    continue
                idle = table is alone and rank >= group
                points = [(nbytes, _collective_time(comm, sub, kind, nbytes, settings.repeats,
                                                    idle)) for nbytes in sizes]
                table.setdefault(kind, {})[group] = _fit_sizes(points)
        every.Free()
        first.Free()
        group *= 2
    return LinkModel(p2p, collectives, alone)


def _fit_sizes(points: list[tuple[int, float]]) -> Fit:
    """Least squares over all sizes, weighted so small and large messages both count."""
    x = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points], float)
    weights = 1.0 / np.maximum(t, 1e-9)
    design = np.stack([np.ones_like(x), x], axis=1) * weights[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * weights, rcond=None)
    return Fit(float(max(a, 0.0)), float(max(b, 0.0)))


def _pair_exchange(comm: Any, nbytes: int, repeats: int) -> float:
    """Seconds for every rank to swap ``nbytes`` with its pair partner at once."""
    rank = comm.Get_rank()
    peer = rank ^ 1
    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    active = peer < comm.Get_size()

    def work() -> None:
        if active:
            comm.Sendrecv(send, dest=peer, recvbuf=recv, source=peer)

    return _synchronised(comm, work, repeats)


def _collective_time(comm: Any, sub: Any, kind: str, nbytes: int, repeats: int,
                     idle: bool = False) -> float:
    """Seconds of one collective whose transfer (cost.py's convention) is ``nbytes``
    (``idle``: this rank only takes part in the timing's barriers)."""
    from mpi4py import MPI

    g = sub.Get_size()
    if g < 2 or idle:
        return _synchronised(comm, lambda: None, repeats)
    count = max(nbytes // 4, g)
    if kind == "allreduce":
        buf = np.ones(count, np.float32)
        work = lambda: sub.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)  # noqa: E731
    elif kind == "allgather":  # nbytes received: (g - 1) blocks, as channel layers send them
        mine = np.ones(_channel_block(count, g), np.float32)
        pieces = [mine.shape[1]] * g
        work = lambda: allgather_channels(sub, mine, pieces)  # noqa: E731
    elif kind == "reduce_scatter":  # nbytes sent: the buffer less my block
        n, c, space, *_ = _channel_block(count, g)
        full = np.ones((n, c * g, space, 1, 1), np.float32)
        pieces = [c] * g
        work = lambda: reduce_scatter_channels(sub, full, pieces)  # noqa: E731
    else:  # alltoall: nbytes sent to the others
        block = max(count // (g - 1), 1)
        out, into = np.ones(block * g, np.float32), np.empty(block * g, np.float32)
        work = lambda: sub.Alltoall(out, into)  # noqa: E731
    return _synchronised(comm, work, repeats)


def _channel_block(count: int, group: int) -> tuple[int, int, int, int, int]:
    """One rank's block of a channel collective whose other ranks' blocks hold ``count``
    elements: 2 samples of 2 channels, each channel a contiguous run of voxels, as a
    layer's activations are (a block of single voxels made the copies to and from
    channel-major order a strided shuffle 4x slower per byte than training's)."""
    samples, channels = 2, 2
    return samples, channels, max(count // (samples * channels * (group - 1)), 1), 1, 1


def _synchronised(comm: Any, work: Callable[[], Any], repeats: int) -> float:
    """Median over repeats of the slowest rank's time, all ranks starting together."""
    from mpi4py import MPI

    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        started = MPI.Wtime()
        work()
        times.append(comm.allreduce(MPI.Wtime() - started, op=MPI.MAX))
    return statistics.median(times[1:])
