"""``cosmotrain calibrate``: fit the cost model's constants on this machine.

Run it with as many ranks as a node will run (``mpiexec -n 4 cosmotrain calibrate -c F``):

1. *layers*: every layer key (kind and local channels) that any strategy for up to that many
   ranks gives the config's model is timed, forward + backward, on rank 0 with one thread
   while the other ranks sleep, at the smallest and the largest local size the strategies
   produce (capped); ``seconds = a + b * elements`` is fitted per key;
2. *concurrency*: a reference of the model's first convolutions runs on ``k`` ranks at once
   (each with the threads the trainer would give it) for every ``k`` up to the job size;
   ``concurrency(k)`` is its time over the lone one-thread time;
3. *elements*: the optimizer update and the input transform, seconds per element;
4. *links*: point-to-point exchanges between rank pairs and each collective the engine
   uses, on every power-of-two communicator size up to the job, all groups at once (as
   segmented collectives run): ``alpha + beta * bytes`` per kind and size.

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
from cosmotrain.perf.cost import layer_elements, layer_key
from cosmotrain.perf.machine import Fit, LinkModel, MachineModel
from cosmotrain.perf.planner import REFUSED, candidates
from cosmotrain.perf.strategy import Strategy
from cosmotrain.perf.workload import LayerWork, build_workload
from cosmotrain.train.optim import build_optimizer

MAX_ELEMENTS = 40_000_000  # largest local output timed per key (W=64, batch 8: conv1 is 34 M)
MESSAGE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 23)
BLOCKS = 3  # timed blocks per concurrency level


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
    if rank == 0:
        log("layers: timing every layer key on one thread")
        samples = layer_samples(cfg, settings.max_ranks)
        machine.layers = _run_alone(comm, lambda: fit_layers(samples, cfg, settings, log))
        machine.element_time = _run_alone(comm, lambda: element_times(cfg, settings))
        machine.flop_rate = flop_rates(machine.layers, samples)
    else:
        _run_alone(comm, lambda: None)
        _run_alone(comm, lambda: None)
    log("concurrency: the reference on 1.." + str(size) + " ranks at once")
    machine.concurrency = concurrency(cfg, comm, cores, settings)
    if size > 1:
        log("links: point-to-point and collectives")
        machine.intra = measure_links(comm, settings)
        machine.inter = machine.intra
        machine.notes = (f"calibrated with {size} rank(s) on one node; inter-node links "
                         "copy the intra-node ones (calibrate across nodes to measure them)")
    return machine if rank == 0 else None


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

def layer_samples(cfg: Config, max_ranks: int) -> dict[str, list[LayerWork]]:
    """Every layer key of every strategy up to ``max_ranks`` ranks, with its local shapes."""
    found: dict[str, dict[tuple[int, ...], LayerWork]] = {}
    for ranks in range(1, max_ranks + 1):
        model, strategies = candidates(cfg, ranks)
        for strategy in strategies:
            try:
                work = build_workload(cfg, strategy, model)
            except REFUSED:  # a split the engine refuses is not timed
                continue
            for layer in work.layers:
                if math.prod(layer.out_shape):
                    found.setdefault(layer_key(layer), {})[layer.in_shape] = layer
    return {key: list(shapes.values()) for key, shapes in found.items()}


def fit_layers(samples: dict[str, list[LayerWork]], cfg: Config, settings: Settings,
               log: Callable[[str], None]) -> dict[str, Fit]:
    """``a + b * elements`` per layer key, from its smallest and largest local size."""
    fits = {}
    for key, layers in sorted(samples.items()):
        chosen = _extremes(layers)
        points = [(layer_elements(layer), time_layer(layer, cfg, settings.repeats))
                  for layer in chosen]
        fits[key] = _fit(points)
        log(f"  {key}: {', '.join(f'{n:.0f} el {t * 1e3:.2f} ms' for n, t in points)}")
    return fits


def _extremes(layers: list[LayerWork]) -> list[LayerWork]:
    """The smallest and the largest (capped) local size of a key."""
    ordered = sorted(layers, key=layer_elements)
    capped = [layer for layer in ordered if layer_elements(layer) <= MAX_ELEMENTS] or \
        [_shrink(ordered[0])]
    if len(capped) > 1:
        return [capped[0], capped[-1]]
    smaller = _shrink(capped[0])  # one size only: add a smaller one if the shape allows
    return [smaller, capped[0]] if smaller != capped[0] else capped


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


def time_layer(layer: LayerWork, cfg: Config, repeats: int) -> float:
    """Median seconds of forward + backward of ``layer`` on random local data."""
    engine = make_layer(layer, cfg)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(layer.in_shape, dtype=np.float32)
    if layer.kind == "Linear":
        x = x.reshape(layer.in_shape[0], -1)
    times, dy = [], None
    for step in range(repeats + 1):
        ctx = Context(training=True, step=step, seed=0)
        fresh = x.copy()  # activations work in place: each repetition gets its own input
        started = time.perf_counter()
        y = engine.forward(fresh, ctx)
        if dy is None:  # allocated once, in the warm-up repetition that is not counted
            dy = np.ones_like(y)
        engine.backward(dy, ctx)
        times.append(time.perf_counter() - started)
        for param in engine.params.values():
            param.grad = None
    return statistics.median(times[1:])


def _fit(points: list[tuple[float, float]]) -> Fit:
    """Least squares ``a + b x`` through the points (a through-origin rate for one point)."""
    if len(points) == 1 or points[0][0] == points[-1][0]:
        x, t = points[-1]
        return Fit(0.0, t / x if x else 0.0)
    (x0, t0), (x1, t1) = points[0], points[-1]
    b = max((t1 - t0) / (x1 - x0), 0.0)
    return Fit(max(t0 - b * x0, 0.0), b)


def flop_rates(fits: dict[str, Fit], samples: dict[str, list[LayerWork]]
               ) -> dict[str, float]:
    """Median FLOP/s of the fitted convolutions and linear layers (fallback for new keys)."""
    rates: dict[str, list[float]] = {}
    for key, layers in samples.items():
        kind = key.split(":")[0]
        if kind not in ("Conv3d", "Linear") or key not in fits:
            continue
        layer = max(layers, key=layer_elements)
        seconds = fits[key](layer_elements(layer))
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
    return {"optimizer": _median_time(update, settings.repeats) / count,
            "input": _median_time(lambda: np.log1p(raw, dtype=np.float32),
                                  settings.repeats) / count}


def _median_time(work: Callable[[], Any], repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- concurrency ------------------------------------------------------------------------

def reference_layers(cfg: Config) -> list[LayerWork]:
    """The model's first two convolutions on one sample at up to 64^3: the reference.

    Large enough that a lone rank's threads speed it up as they do the real step (at
    32^3 two threads gained 1.2x where the W=64 step gains 1.8x)."""
    sized = replace(cfg, model=replace(cfg.model, width=min(cfg.model.width, 64)),
                    train=replace(cfg.train, batch_size=1))
    work = build_workload(sized, Strategy(1))
    return [layer for layer in work.layers if layer.kind == "Conv3d"][:2]


def concurrency(cfg: Config, comm: Any, cores: int, settings: Settings) -> dict[int, float]:
    """``k -> time of the reference on k ranks at once / alone on one thread``.

    Each rank times its whole block of repetitions from a common start: timing single
    repetitions would miss the contention, as oversubscribed ranks take turns on a core.
    """
    reference = [(make_layer(layer, cfg), layer) for layer in reference_layers(cfg)]
    rounds = 2 * settings.repeats

    def run() -> float:
        _reference_block(reference, 1)  # warm-up: buffers, caches
        started = time.perf_counter()
        _reference_block(reference, rounds)
        return time.perf_counter() - started

    alone = comm.bcast(_run_alone(comm, lambda: statistics.median(
        run() for _ in range(BLOCKS))), root=0)
    result = {}
    for k in range(1, comm.Get_size() + 1):
        busy = comm.Get_rank() < k
        slowest = []
        for _ in range(BLOCKS):  # the median of a few blocks: single blocks vary by 10-20%
            if busy:
                _parallel.set_blas_threads(threads_per_rank(k, cores, cores))
            _quiet_barrier(comm)
            seconds = run() if busy else 0.0
            _quiet_barrier(comm)
            _parallel.set_blas_threads(1)
            slowest.append(comm.allreduce(seconds, op=_max()))
        result[k] = statistics.median(slowest) / alone
    return result


def _reference_block(reference: list[tuple[Layer, LayerWork]], rounds: int) -> None:
    """Forward + backward of the reference layers, ``rounds`` times."""
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(work.in_shape, dtype=np.float32) for _, work in reference]
    for step in range(rounds):
        ctx = Context(training=True, step=step, seed=0)
        for (layer, _), x in zip(reference, inputs):
            y = layer.forward(x.copy(), ctx)
            layer.backward(np.ones_like(y), ctx)
            for param in layer.params.values():
                param.grad = None


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


# --- links ------------------------------------------------------------------------------

def measure_links(comm: Any, settings: Settings) -> LinkModel:
    """Point-to-point and collective alpha-beta fits on this job's ranks."""
    size = comm.Get_size()
    p2p = _fit_sizes([(nbytes, _pair_exchange(comm, nbytes, settings.repeats))
                      for nbytes in MESSAGE_BYTES])
    collectives: dict[str, dict[int, Fit]] = {}
    group = 2
    while group <= size:
        sub = comm.Split(comm.Get_rank() // group if comm.Get_rank() < size // group * group
                         else size, comm.Get_rank())
        for kind in ("allreduce", "allgather", "reduce_scatter", "alltoall"):
            points = [(nbytes, _collective_time(comm, sub, kind, nbytes, settings.repeats))
                      for nbytes in MESSAGE_BYTES]
            collectives.setdefault(kind, {})[group] = _fit_sizes(points)
        sub.Free()
        group *= 2
    return LinkModel(p2p, collectives)


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


def _collective_time(comm: Any, sub: Any, kind: str, nbytes: int, repeats: int) -> float:
    """Seconds of one collective whose transfer (cost.py's convention) is ``nbytes``."""
    from mpi4py import MPI

    g = sub.Get_size()
    if g < 2:
        return _synchronised(comm, lambda: None, repeats)
    count = max(nbytes // 4, g)
    if kind == "allreduce":
        buf = np.ones(count, np.float32)
        work = lambda: sub.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)  # noqa: E731
    elif kind == "allgather":  # nbytes received: (g - 1) blocks of count / (g - 1)
        block = max(count // (g - 1), 1)
        mine, every = np.ones(block, np.float32), np.empty(block * g, np.float32)
        work = lambda: sub.Allgather(mine, every)  # noqa: E731
    elif kind == "reduce_scatter":  # nbytes sent: the buffer less my block
        block = max(count // (g - 1), 1)
        full, mine = np.ones(block * g, np.float32), np.empty(block, np.float32)
        work = lambda: sub.Reduce_scatter_block(full, mine, op=MPI.SUM)  # noqa: E731
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
