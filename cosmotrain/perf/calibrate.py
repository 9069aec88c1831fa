"""``cosmotrain calibrate``: fit the cost model's constants on this machine.

Run it with as many ranks as a node will run (``mpiexec -n 4 cosmotrain calibrate -c F``):

1. *layers*: every layer key (kind and local channels) that any strategy for up to that many
   ranks gives the config's model is timed, forward + backward, at up to ``MAX_POINTS`` of
   the local sizes the strategies produce, with ``k`` ranks running it at once (each with
   the threads the trainer would give it) for ``k`` = 1, 2, 4, ... and the job size: one
   :class:`~cosmotrain.perf.machine.Curve` per level and key.  Timing every level is what
   makes the model hold for data-parallel and spatial steps alike: how much sharing a node
   slows a layer depends on the layer (memory-bound pooling and thin convolutions suffer
   most), which a single node-wide factor cannot express;
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

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cosmotrain.comm.threads import threads_per_rank
from cosmotrain.config.schema import Config
from cosmotrain.kernels import _parallel
from cosmotrain.kernels.geometry import normalize_padding
from cosmotrain.nn import factory
from cosmotrain.nn.layers import Dropout, Flatten, LeakyReLU, Pool3d
from cosmotrain.nn.module import Context, Layer, Parameter
from cosmotrain.perf.cost import BYTES, layer_elements, layer_key
from cosmotrain.perf.machine import Curve, Fit, LinkModel, MachineModel
from cosmotrain.perf.planner import REFUSED, candidates
from cosmotrain.perf.workload import LayerWork, Workload, build_workload
from cosmotrain.tensor.channel_collectives import allgather_channels, reduce_scatter_channels
from cosmotrain.train.optim import build_optimizer

MAX_ELEMENTS = 40_000_000  # largest local output timed per key (W=64, batch 8: conv1 is 34 M)
MAX_POINTS = 5  # local sizes timed per key and level
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
    samples = layer_samples(works)
    for k in levels(size):
        log(f"layers: every layer key with {k} rank(s) at once")
        machine.layers[k] = layer_curves(samples, cfg, comm, k, cores, settings, log)
    machine.concurrency = concurrency_of(machine.layers)
    machine.flop_rate = flop_rates(machine.layers[1], samples)
    machine.element_time = _run_alone(comm, lambda: element_times(cfg, settings))
    if size > 1:
        log("links: point-to-point and collectives")
        machine.intra = measure_links(comm, settings, message_sizes(works))
        machine.inter = machine.intra
        machine.notes = (f"calibrated with {size} rank(s) on one node; inter-node links "
                         "copy the intra-node ones (calibrate across nodes to measure them)")
    return machine if rank == 0 else None


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
    _quiet_barrier(comm)
    return result


def _quiet_barrier(comm: Any) -> None:
    """A barrier that sleeps while it waits, so waiting ranks leave the cores free."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


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


def layer_samples(works: list[Workload]) -> dict[str, list[LayerWork]]:
    """Every layer key of ``works``, with its distinct local shapes."""
    found: dict[str, dict[tuple[int, ...], LayerWork]] = {}
    for work in works:
        for layer in work.layers:
            if math.prod(layer.out_shape):
                found.setdefault(layer_key(layer), {})[layer.in_shape] = layer
    return {key: list(shapes.values()) for key, shapes in found.items()}


def layer_curves(samples: dict[str, list[LayerWork]], cfg: Config, comm: Any, k: int,
                 cores: int, settings: Settings, log: Callable[[str], None]
                 ) -> dict[str, Curve]:
    """Every key's curve with ranks ``0..k-1`` running each layer at once (collective)."""
    busy = comm.Get_rank() < k
    curves = {}
    for key, layers in sorted(samples.items()):
        points = []
        for layer in timed_sizes(layers):
            if busy:
                _parallel.set_blas_threads(threads_per_rank(k, cores, cores))
                times = time_layer(layer, cfg, settings.repeats, lambda: _quiet_barrier(comm))
            else:
                times = [_quiet_barrier(comm) or 0.0 for _ in range(settings.repeats)]
            _parallel.set_blas_threads(1)
            slowest = np.empty(settings.repeats)
            comm.Allreduce(np.array(times, dtype=np.float64), slowest, op=_max())
            points.append((layer_elements(layer), float(np.median(slowest))))
        curves[key] = Curve(points)
        log(f"  {key}: {', '.join(f'{n:.0f} el {t * 1e3:.2f} ms' for n, t in points)}")
    return curves


def timed_sizes(layers: list[LayerWork]) -> list[LayerWork]:
    """Up to ``MAX_POINTS`` local sizes of a key, spread from the smallest to the largest
    (capped; a key with one size gets a smaller second one, so the curve has a slope)."""
    by_size = {layer_elements(layer): layer for layer in layers}
    ordered = [by_size[n] for n in sorted(by_size)]
    capped = [layer for layer in ordered if layer_elements(layer) <= MAX_ELEMENTS] or \
        [_shrink(ordered[0])]
    if len(capped) == 1:
        smaller = _shrink(capped[0])
        return [smaller, capped[0]] if smaller != capped[0] else capped
    picks = np.unique(np.linspace(0, len(capped) - 1, min(MAX_POINTS, len(capped)))
                      .round().astype(int))
    return [capped[i] for i in picks]


def _shrink(layer: LayerWork) -> LayerWork:
    """The same layer on fewer samples (or half the depth): a second, smaller point."""
    if layer.in_shape[0] > 1:
        n = max(1, layer.in_shape[0] // 2)
        return replace(layer, in_shape=(n,) + layer.in_shape[1:],
                       out_shape=(n,) + layer.out_shape[1:])
    if len(layer.in_shape) == 5 and layer.in_shape[2] >= 8 and layer.stride[0] == 1:
        d = layer.in_shape[2] // 2
        return replace(layer, in_shape=layer.in_shape[:2] + (d,) + layer.in_shape[3:],
                       out_shape=layer.out_shape[:2] + (d,) + layer.out_shape[3:])
    return layer


def make_layer(layer: LayerWork, cfg: Config) -> Layer:
    """A standalone engine layer of ``layer``'s kind and local channels."""
    if layer.kind == "Conv3d":
        conv = factory.conv(layer.name, layer.in_shape[1], layer.out_shape[1],
                            layer.kernel[0], layer.stride[0], layer.kernel[0] // 2)
        conv.params["weight"].data[...] = 0.01
        conv.needs_input_grad = layer.input_grad
        return conv
    if layer.kind == "Pool3d":
        return Pool3d(name=layer.name, mode="avg", kernel=layer.kernel, stride=layer.stride,
                      padding=normalize_padding(layer.kernel[0] // 2))
    if layer.kind == "BatchNorm3d":
        return factory.batchnorm(layer.name, layer.in_shape[1])
    if layer.kind == "Linear":
        linear = factory.linear(layer.name, math.prod(layer.in_shape[1:]), layer.out_shape[1])
        linear.params["weight"].data[...] = 0.01
        return linear
    if layer.kind == "Dropout":
        return Dropout(name=layer.name, p=0.5)
    if layer.kind == "Flatten":
        return Flatten(name=layer.name)
    return LeakyReLU(name=layer.name, slope=cfg.model.leaky_slope or 0.01)


def time_layer(layer: LayerWork, cfg: Config, repeats: int,
               sync: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of each of ``repeats`` forward + backward passes of ``layer`` on random local
    data, after a warm-up; ``sync`` (a barrier) starts every pass together with the other
    busy ranks, so that ranks sharing a core are timed sharing it.  The caller takes the
    slowest rank per pass and the median pass (robust to a passing disturbance)."""
    engine = make_layer(layer, cfg)
    x = np.random.default_rng(0).standard_normal(layer.in_shape, dtype=np.float32)
    if layer.kind == "Linear":
        x = x.reshape(layer.in_shape[0], -1)
    dy = _forward_backward(engine, x.copy(), None, 0)  # warm-up: buffers, caches
    times = []
    for step in range(1, repeats + 1):
        fresh = x.copy()  # activations work in place: each pass gets its own input
        sync()
        started = time.perf_counter()
        _forward_backward(engine, fresh, dy, step)
        times.append(time.perf_counter() - started)
    return times


def _forward_backward(engine: Layer, x: Any, dy: Any, step: int) -> Any:
    """One training pass of ``engine``; returns the output gradient it used."""
    ctx = Context(training=True, step=step, seed=0)
    y = engine.forward(x, ctx)
    dy = np.ones_like(y) if dy is None else dy
    engine.backward(dy, ctx)
    for param in engine.params.values():
        param.grad = None
    return dy


def flop_rates(curves: dict[str, Curve], samples: dict[str, list[LayerWork]]
               ) -> dict[str, float]:
    """Median FLOP/s of one rank's convolutions and linear layers (fallback for new keys)."""
    rates: dict[str, list[float]] = {}
    for key, layers in samples.items():
        kind = key.split(":")[0]
        if kind not in ("Conv3d", "Linear") or key not in curves:
            continue
        layer = max(layers, key=layer_elements)
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


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


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
        mine = np.ones((2, max(count // (2 * (g - 1)), 1), 1, 1, 1), np.float32)
        pieces = [mine.shape[1]] * g
        work = lambda: allgather_channels(sub, mine, pieces)  # noqa: E731
    elif kind == "reduce_scatter":  # nbytes sent: the buffer less my block
        block = max(count // (2 * (g - 1)), 1)
        full = np.ones((2, block * g, 1, 1, 1), np.float32)
        pieces = [block] * g
        work = lambda: reduce_scatter_channels(sub, full, pieces)  # noqa: E731
    else:  # alltoall: nbytes sent to the others
        block = max(count // (g - 1), 1)
        out, into = np.ones(block * g, np.float32), np.empty(block * g, np.float32)
        work = lambda: sub.Alltoall(out, into)  # noqa: E731
    return _synchronised(comm, work, repeats)


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
