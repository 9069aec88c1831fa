"""Time every layer key as training runs it: inside whole steps, ``k`` ranks at once.

``cosmotrain calibrate`` prices compute from what this module measures.  For each level
``k`` of ranks per node it runs the local layer list of every strategy a job with ``k``
ranks per node could use (the candidate workloads of ``k`` or more ranks), forward through
all layers then backward through them in reverse, exactly the order of a training step,
on ranks ``0..k-1`` at once with one barrier per pass.  Each layer's forward + backward is
timed inside the pass; a point is the median over passes of the layer's share of the
slowest rank's pass (:func:`slowest_step_shares`).

Why whole steps rather than one layer at a time: ranks that share a node only collide
where their phases line up.  Timing each layer on its own with a barrier before every pass
makes two memory-bound passes (pooling, the first convolution) always collide, which in
training they mostly do not: on the 2-core development machine that priced two-rank
pooling at 2.2x and ``conv3`` at 1.7x what a two-rank step spends on them, and N2's whole
step 31% high (docs/PERFORMANCE.md).  Inside a step the ranks drift as they do in
training, so the points are what the step pays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from cosmotrain.runtime.threads import threads_per_rank
from cosmotrain.config.schema import Config
from cosmotrain.kernels.cpu import workers
from cosmotrain.kernels.geometry import normalize_padding
from cosmotrain.nn import containers, factory
from cosmotrain.nn.layers import Dropout, Flatten, LeakyReLU, Pool3d
from cosmotrain.nn.module import Context, Layer
from cosmotrain.plan.cost import layer_elements, layer_key, shape_key
from cosmotrain.plan.machine import Curve
from cosmotrain.plan.workload import BLOCKS, LayerWork, Workload

MAX_ELEMENTS = 40_000_000  # a step whose largest local output is larger runs fewer samples
WARMUP_PASSES = 2  # untimed passes first: fresh allocations of a new step's sizes page in
Sequence = tuple[LayerWork, ...]


def level_sequences(works: list[Workload], k: int) -> list[Sequence]:
    """The distinct local layer lists a job with ``k`` ranks per node runs: those of the
    workloads of ``k`` or more ranks, the ``k``-rank ones (a single node's) first, each
    capped at ``MAX_ELEMENTS`` by running fewer samples."""
    found: dict[tuple[Any, ...], Sequence] = {}
    for work in sorted((w for w in works if w.ranks >= k), key=lambda w: w.ranks):
        sequence = capped(tuple(layer for layer in work.layers
                                if math.prod(layer.out_shape)))
        found.setdefault(tuple((layer_key(layer), layer.in_shape) for layer in sequence),
                         sequence)
    return list(found.values())


def capped(sequence: Sequence) -> Sequence:
    """``sequence`` on half the samples, repeatedly, while a layer's output exceeds
    ``MAX_ELEMENTS`` (a point's time scales with its elements along the key's curve)."""
    while sequence and max(map(layer_elements, sequence)) > MAX_ELEMENTS and \
            all(layer.in_shape[0] > 1 for layer in sequence):
        sequence = tuple(with_samples(layer, layer.in_shape[0] // 2) for layer in sequence)
    return sequence


def with_samples(layer: LayerWork, samples: int) -> LayerWork:
    """``layer`` on ``samples`` local samples."""
    return replace(layer, in_shape=(samples,) + layer.in_shape[1:],
                   out_shape=(samples,) + layer.out_shape[1:])


def shrunk(layer: LayerWork) -> LayerWork:
    """The same layer on fewer samples (or half the depth): a second, smaller point for a
    key seen at one size only, so that its curve has a slope and an intercept."""
    if layer.in_shape[0] > 1:
        return with_samples(layer, max(1, layer.in_shape[0] // 2))
    if len(layer.in_shape) == 5 and layer.in_shape[2] >= 8 and layer.stride[0] == 1:
        d = layer.in_shape[2] // 2
        return replace(layer, in_shape=layer.in_shape[:2] + (d,) + layer.in_shape[3:],
                       out_shape=layer.out_shape[:2] + (d,) + layer.out_shape[3:])
    return layer


def layer_curves(works: list[Workload], cfg: Config, comm: Any, k: int, cores: int,
                 repeats: int, log: Callable[[str], None]
                 ) -> tuple[dict[str, Curve], dict[str, float]]:
    """Every key's curve and every exact shape's seconds (``shape_key``) with ranks
    ``0..k-1`` running whole steps at once (collective).

    A step is only run when it has a shape not measured yet at this level; a curve point
    is the median of the shapes with its key and output elements (layouts differ); keys
    seen at a single size get a second, smaller point from one more step made of their
    shrunk layers."""
    points: dict[tuple[str, float], list[float]] = {}
    exact: dict[str, list[float]] = {}
    for sequence in level_sequences(works, k):
        if all(shape_key(layer) in exact for layer in sequence):
            continue
        seconds = timed_sequence(sequence, cfg, comm, k, cores, repeats)
        _record(points, sequence, seconds)
        for layer, value in zip(sequence, seconds):
            exact.setdefault(shape_key(layer), []).append(float(value))
    extra = second_points(points, level_sequences(works, k))
    if extra:
        _record(points, extra, timed_sequence(extra, cfg, comm, k, cores, repeats,
                                              fuse=False))
    curves: dict[str, list[tuple[float, float]]] = {}
    for (key, elements), seconds in sorted(points.items()):
        curves.setdefault(key, []).append((elements, float(np.median(seconds))))
    for key, pts in curves.items():
        log(f"  {key}: {', '.join(f'{n:.0f} el {t * 1e3:.2f} ms' for n, t in pts)}")
    return ({key: Curve(pts) for key, pts in curves.items()},
            {shape: float(np.median(seconds)) for shape, seconds in exact.items()})


def second_points(points: dict[tuple[str, float], list[float]], sequences: list[Sequence]
                  ) -> Sequence:
    """A shrunk layer of every key measured at one size only (one step of them)."""
    sizes: dict[str, set[float]] = {}
    for key, elements in points:
        sizes.setdefault(key, set()).add(elements)
    extra = {layer_key(layer): shrunk(layer) for sequence in sequences for layer in sequence
             if len(sizes[layer_key(layer)]) == 1}
    return tuple(layer for layer in extra.values()
                 if (layer_key(layer), layer_elements(layer)) not in points)


def _record(points: dict[tuple[str, float], list[float]], sequence: Sequence,
            seconds: np.ndarray) -> None:
    for layer, value in zip(sequence, seconds):
        points.setdefault((layer_key(layer), layer_elements(layer)), []).append(float(value))


def timed_sequence(sequence: Sequence, cfg: Config, comm: Any, k: int, cores: int,
                   repeats: int, fuse: bool = True) -> np.ndarray:
    """Per layer, the median over passes of its share of the slowest busy rank's step
    (collective: ranks ``k`` and up only take part in the barriers).

    A pass's layer times are the mean over the busy ranks, scaled so that they add up to
    the slowest rank's whole pass (:func:`slowest_step_shares`).  ``fuse``: neighbours
    fuse as in training (:class:`StepTimer`); False for a step of unrelated layers."""
    busy = comm.Get_rank() < k
    engines = [make_layer(layer, cfg) for layer in sequence] if busy else []
    step = StepTimer(engines, sequence, fuse) if busy else None
    passes = np.zeros((WARMUP_PASSES + repeats, len(sequence)))
    if busy:
        workers.set_blas_threads(threads_per_rank(k, cores, cores))
    for i in range(len(passes)):
        if step:
            passes[i] = step.run(lambda: quiet_barrier(comm), i)
        else:
            quiet_barrier(comm)
    workers.set_blas_threads(1)
    quiet_barrier(comm)  # idle ranks must not spin in the reductions while others work
    summed, longest = np.empty_like(passes), np.empty(len(passes))
    comm.Allreduce(passes, summed, op=_op("SUM"))
    comm.Allreduce(passes.sum(axis=1), longest, op=_op("MAX"))
    shares = slowest_step_shares(summed / k, longest)
    return np.median(shares[WARMUP_PASSES:], axis=0)


def slowest_step_shares(mean: np.ndarray, longest: np.ndarray) -> np.ndarray:
    """Per pass (rows) and layer (columns): the mean layer times over the ranks, scaled
    to add up to the slowest rank's pass (``longest``).

    Why neither the mean nor each layer's slowest rank: ranks that synchronise wait for
    the slowest, so the mean is too low where one rank is persistently slower (two ranks
    on two cores, a 50 ms step spread); but where ranks take turns (more ranks than cores,
    which the scheduler time-slices), each layer's slowest rank is a different one, and
    their sum priced four-rank steps 5-16% above the slowest rank's whole pass."""
    totals = mean.sum(axis=1, keepdims=True)
    return mean * np.divide(longest[:, None], totals, out=np.ones_like(totals),
                            where=totals > 0)


class StepTimer:
    """Runs standalone engine layers as one training step and times each of them.

    Inputs and output gradients are random arrays of each layer's local shapes, copied
    afresh before every pass (activations work in place) and outside the timing.

    With ``fuse``, neighbours that the step's ``Sequential`` runs fused are fused here too,
    by the same protocol (``nn/containers.py``): a convolution applies the LeakyReLU after
    it in its kernels, the first convolution runs that activation's backward in its filter
    gradient, an average pooling the backward of the activation before it; the fused
    activation then costs (nearly) nothing and its neighbour what it costs in training.
    Neighbours are linked as the model links them (:func:`_linked`); the layers of a step
    of unrelated shrunk layers are not (``fuse`` False)."""

    def __init__(self, engines: list[Layer], sequence: Sequence, fuse: bool = True) -> None:
        rng = np.random.default_rng(0)
        self.engines = engines
        self.inputs = [_input(layer, rng) for layer in sequence]
        ctx = Context(training=True, step=0, seed=0)
        self.grads = [np.ones_like(engine.forward(x.copy(), ctx))
                      for engine, x in zip(engines, self.inputs)]
        self.chain_start = _chain_starts(sequence, fuse)
        self._clear()

    def run(self, sync: Callable[[], None], step: int) -> np.ndarray:
        """One pass after ``sync``: forward through every layer, backward in reverse."""
        inputs = [x.copy() for x in self.inputs]
        grads = [dy.copy() for dy in self.grads]
        seconds = np.zeros(len(self.engines))
        ctx = Context(training=True, step=step, seed=0)
        sync()
        for i, engine in enumerate(self.engines):
            started = time.perf_counter()
            self._offer_activation(i)
            engine.forward(inputs[i], ctx)
            seconds[i] += time.perf_counter() - started
        for i in reversed(range(len(self.engines))):
            started = time.perf_counter()
            if not self._handed_over(i):
                self.engines[i].backward(grads[i], ctx)
            seconds[i] += time.perf_counter() - started
        self._clear()
        return seconds

    def _offer_activation(self, i: int) -> None:
        """Before layer ``i``'s forward, as ``Sequential.forward`` does: it may apply the
        activation after it, when the two are linked."""
        linked = i + 1 < len(self.engines) and self.chain_start[i + 1] <= i
        if linked and containers.FUSE_ACTIVATIONS:
            follower = self.engines[i + 1]
            applied = self.engines[i].take_activation(follower.activation_slope())
            follower.set_applied_by_previous(applied)

    def _handed_over(self, i: int) -> bool:
        """Before layer ``i``'s backward, as ``Sequential.backward`` does: True when a layer
        before it runs this backward; else it may take the activation before it."""
        before = self.engines[self.chain_start[i]:i]
        if not before or not containers.FUSE_ACTIVATIONS:
            return False
        if self.engines[i].hand_over_backward(before):
            return True
        self.engines[i].take_preceding_activation(before)
        return False

    def _clear(self) -> None:
        for engine in self.engines:
            for param in engine.params.values():
                param.grad = None


def _chain_starts(sequence: Sequence, fuse: bool) -> list[int]:
    """For each layer, the first layer of the run of linked neighbours it belongs to
    (itself when it is linked to none)."""
    starts: list[int] = []
    for i, layer in enumerate(sequence):
        linked = fuse and i > 0 and _linked(sequence[i - 1], layer)
        starts.append(starts[i - 1] if linked else i)
    return starts


def _linked(before: LayerWork, layer: LayerWork) -> bool:
    """Whether training may fuse ``layer`` with the one ``before`` it: two layers of one
    part (the block part and the sample part are separate sequences), but on blocks a
    spatial pooling never takes the activation before it and a channel convolution
    (all-gathered input, reduce-scattered output) neither applies one nor takes its
    backward (``layers/pool.py``, ``layers/channel_conv.py``)."""
    if before.part != layer.part:
        return False
    if layer.part == BLOCKS:
        channel = any(t.kind in ("allgather", "reduce_scatter") for t in before.transfers)
        return layer.kind != "Pool3d" and not channel
    return True


def _input(layer: LayerWork, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(layer.in_shape, dtype=np.float32)
    return x.reshape(layer.in_shape[0], -1) if layer.kind == "Linear" else x


def make_layer(layer: LayerWork, cfg: Config) -> Layer:
    """A standalone engine layer of ``layer``'s kind and local channels."""
    if layer.kind == "Conv3d":
        conv = factory.conv(layer.name, layer.in_shape[1], layer.out_shape[1],
                            layer.kernel[0], layer.stride[0], layer.kernel[0] // 2)
        conv.params["weight"].data[...] = 0.01
        conv.needs_input_grad = layer.input_grad
        return conv
    if layer.kind == "Pool3d":
        return Pool3d(name=layer.name, mode=layer.mode or "avg", kernel=layer.kernel,
                      stride=layer.stride, padding=normalize_padding(_pool_padding(layer)))
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


def _pool_padding(layer: LayerWork) -> int:
    """The padding that gives the pooling its output depth from its input depth (the
    paper network's 3/2 poolings pad 1, MLPerf's 2/2 ones none)."""
    k, s = layer.kernel[0], layer.stride[0]
    excess = (layer.out_shape[2] - 1) * s + k - layer.in_shape[2]
    return max(0, -(-excess // 2))


def quiet_barrier(comm: Any) -> None:
    """A barrier that sleeps while it waits, so waiting ranks leave the cores free."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def _op(name: str) -> Any:
    from mpi4py import MPI

    return getattr(MPI, name)
