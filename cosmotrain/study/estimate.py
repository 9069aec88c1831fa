"""A quick probe of this machine when nothing is calibrated, cached beside the machine file.

``cosmotrain plan`` and ``parallel: auto`` need a machine model; ``cosmotrain calibrate``
makes a measured one but takes minutes and MPI.  On first use without one, this module
times, in one process and a few seconds, the engine's own layers on CosmoFlow's first
three blocks at width 64 (one sample, with batch norm) plus a linear layer, first with
every core's threads (what the trainer gives a rank alone on its node), then with one
thread (how much threads help, hence how ranks sharing the node slow each other), each the
fastest of ``REPEATS`` training passes, and the per-element times of the optimizer, the
input transform and a copy (:func:`cosmotrain.study.calibrate.element_times`).  Other
jobs on the machine make every number slower (the 2-core development machine, loaded by
other test runs, gave 9 GFLOP/s for the convolutions where quieter moments gave 25-42), so
a busy machine is reported before the probe.  :mod:`cosmotrain.plan.estimate` turns
the numbers into a machine model marked ``source: estimate``, saved atomically next to the
calibrated file's place (``machine.estimate.json`` beside ``machine.json``) and reused on
the same processor and core count.  The calibrated file is never written here, so a
calibration always wins and nothing mistakes an estimate for one.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cosmotrain.config.layout import resolve_parallel
from cosmotrain.config.load import load_config
from cosmotrain.config.schema import Config
from cosmotrain.errors import UserError
from cosmotrain.kernels.cpu import workers
from cosmotrain.plan.cost import layer_elements
from cosmotrain.plan.estimate import MEASURED_KINDS, Probe, estimate_name, estimated_machine
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.workload import LayerWork, build_workload
from cosmotrain.study.calibrate import Settings, element_times
from cosmotrain.study.layer_timing import StepTimer, make_layer, with_samples

PROBE_CONFIG = ("model.name=cosmoflow", "model.width=64", "model.batchnorm=true",
                "train.batch_size=1")
BLOCKS = 3  # CosmoFlow's first blocks: where nearly all of its step time goes
LINEAR_SAMPLES = 64  # the linear layer on enough samples to time its GEMM, not its call
REPEATS = 3


def estimate_path(machine_file: Path) -> Path:
    """Where the estimate of the machine whose calibrated file is ``machine_file`` lives."""
    return machine_file.with_name(f"{machine_file.stem}.estimate.json")


def cached_estimate(path: Path, log: Callable[[str], None]) -> tuple[MachineModel, str]:
    """The estimate cached at ``path`` if it is this processor's, else a fresh probe saved
    there (a cache that cannot be written is reported, not fatal); and where it is."""
    name = estimate_name(cpu_name(), os.cpu_count() or 1)
    try:
        cached = MachineModel.load(path) if path.is_file() else None
    except UserError:
        cached = None
    if cached is not None and cached.source == "estimate" and cached.name == name:
        return cached, f"cached in {path}"
    log(f"no calibrated machine model: measuring a quick estimate of this machine "
        f"(a few seconds on a quiet machine; cached in {path})")
    busy = _load()
    if busy:
        log(f"  this machine is busy ({busy}): the estimate will be slower than the machine "
            f"is; delete {path} to measure again when it is quiet")
    machine = estimated_machine(probe(log))
    try:
        machine.save(path, where="COSMOTRAIN_MACHINE")
    except (UserError, OSError) as err:
        return machine, f"not cached ({err})"
    return machine, f"saved to {path}"


def probe(log: Callable[[str], None] = lambda line: None) -> Probe:
    """Time the probe's layers and element operations on this process (see the module
    docstring); the BLAS thread count is restored afterwards."""
    cores = os.cpu_count() or 1
    cfg = load_config(None, PROBE_CONFIG)
    sequence = probe_sequence(cfg)
    # unfused: the probe prices each kind per element (dropout by LeakyReLU's rate)
    timer = StepTimer([make_layer(layer, cfg) for layer in sequence], sequence, fuse=False)
    before = workers.num_workers()
    try:
        seconds, speedup = _thread_passes(timer, cores, log)
        log("  optimizer, input transform, copy")
        elements = element_times(cfg, Settings(repeats=REPEATS))
    finally:
        workers.set_blas_threads(max(before, 1))
    return Probe(cpu=cpu_name(), cores=cores, memory_gib=_memory_gib(),
                 conv_flop_rate=_flop_rate(sequence, seconds, "Conv3d"),
                 linear_flop_rate=_flop_rate(sequence, seconds, "Linear"),
                 element_time={**elements, **_element_rates(sequence, seconds)},
                 thread_speedup=speedup)


def _thread_passes(timer: StepTimer, cores: int, log: Callable[[str], None]
                   ) -> tuple[np.ndarray, float]:
    """Per layer, a lone rank's seconds with every core's threads, and one thread's time
    over that.  A layer that ran faster on one thread gets that time: a quiet machine's
    threads never slow it, only other jobs holding the cores do."""
    log(f"  layers with {cores} thread(s)")
    if not workers.set_blas_threads(cores) or cores == 1:
        return _fastest_pass(timer), float(cores)  # BLAS threads itself: an even split
    many = _fastest_pass(timer)
    log("  layers with 1 thread")
    workers.set_blas_threads(1)
    one = _fastest_pass(timer)
    many = np.minimum(many, one)
    return many, float(one.sum() / many.sum())


def probe_sequence(cfg: Config) -> tuple[LayerWork, ...]:
    """The layers of one CosmoFlow sample up to the ``BLOCKS``-th pooling, then its widest
    linear layer on ``LINEAR_SAMPLES`` samples, as the planner's workload describes them."""
    work = build_workload(cfg, resolve_parallel(cfg, 1))
    layers: list[LayerWork] = []
    for layer in work.layers:
        layers.append(layer)
        if sum(item.kind == "Pool3d" for item in layers) == BLOCKS:
            break
    linear = max((layer for layer in work.layers if layer.kind == "Linear"),
                 key=lambda layer: layer.forward_flops)
    return (*layers, with_samples(linear, LINEAR_SAMPLES))


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fastest_pass(timer: StepTimer) -> np.ndarray:
    """Per layer, the fastest of ``REPEATS`` training passes after one untimed warm-up:
    other work on the machine only ever slows a pass down (two threads sharing a core
    with another job ran a convolution 5x slower), and a cached estimate should be what
    the machine does when the job has it to itself."""
    timer.run(lambda: None, 0)
    return np.min([timer.run(lambda: None, i + 1) for i in range(REPEATS)], axis=0)


def _flop_rate(sequence: tuple[LayerWork, ...], seconds: np.ndarray, kind: str) -> float:
    pairs = [(layer.forward_flops + layer.backward_flops, t)
             for layer, t in zip(sequence, seconds) if layer.kind == kind]
    return sum(f for f, _ in pairs) / max(sum(t for _, t in pairs), 1e-12)


def _element_rates(sequence: tuple[LayerWork, ...], seconds: np.ndarray
                   ) -> dict[str, float]:
    """Seconds per element (``layer_elements``, as the cost model counts them) per kind."""
    rates = {}
    for kind in MEASURED_KINDS:
        pairs = [(layer_elements(layer), t) for layer, t in zip(sequence, seconds)
                 if layer.kind == kind]
        if pairs:
            rates[kind] = statistics.fsum(t for _, t in pairs) / sum(n for n, _ in pairs)
    return rates


def _load() -> str:
    """``load L on C cores`` when other work holds over half the cores, else ``""``."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return ""
    return f"load {load:.1f} on {cores} cores" if load > cores / 2 else ""


def _memory_gib() -> float:
    """Physical memory of this node, as a calibration records it (0 when unknown)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0
