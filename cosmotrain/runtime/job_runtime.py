"""The per-job runtime: what a job's builders need beyond the grid's topology.

A :class:`Runtime` is built once when a job is built (:func:`build_runtime`, after the
device is selected and the grid exists) and handed to the builders: the distributed
layers, the halo exchanges and the gradient reducer take their transport and phase
timers from it, never from the :class:`~cosmotrain.comm.grid.ProcessGrid`, which is
pure topology; the convolution and linear layers take the GPU kernel settings
(``conv``) and pass them to every kernel call.  Nothing here is installed process-wide
except the kernel threads (``threads``), which :func:`build_runtime` applies once
through :func:`cosmotrain.kernels.cpu.workers.configure_threads` because OpenBLAS's thread
count is process-global state of the C library (see ``kernels/cpu/workers.py``), and, when
asked, glibc's keeping of freed memory (:mod:`cosmotrain.device.heap`), for the same
reason.

The default ``Runtime()`` is the host's: the numpy pass-through transport, fresh
timers, the default convolution settings, and ``threads=None`` (the process's threads
left as they are): what a test or a tool that builds a layer by hand gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosmotrain.runtime.timers import PhaseTimers
from cosmotrain.device import step_memory
from cosmotrain.device.heap import reuse_freed_memory
from cosmotrain.device.select import Device
from cosmotrain.comm.transport import Transport, make_transport
from cosmotrain.kernels.cpu.workers import KernelThreads, configure_threads
from cosmotrain.kernels.cuda.settings import ConvSettings, settings_for


@dataclass(frozen=True)
class Runtime:
    """One job's device, transport (how buffers cross MPI), communication timers, GPU
    convolution settings and kernel threads (None: not set by this runtime)."""

    device: Device = field(default_factory=Device)
    transport: Transport = field(default_factory=make_transport)
    timers: PhaseTimers = field(default_factory=PhaseTimers)
    conv: ConvSettings = field(default_factory=ConvSettings)
    threads: KernelThreads | None = None


def build_runtime(device: Device, comm: Any, threads: KernelThreads | None = None,
                  reuse_memory: bool = False, plan_memory: bool = False) -> Runtime:
    """The runtime of a job on ``device`` whose ranks are ``comm`` (the grid's ``cart``;
    collective on a GPU, where the transport follows ``device.communication`` and is
    prepared over ``comm``).

    ``threads`` (the job's :func:`~cosmotrain.runtime.threads.job_threads`) are applied to
    this process here, once; None leaves the process's threads as they are.
    ``reuse_memory`` keeps freed host memory in the heap from now on
    (:func:`~cosmotrain.device.heap.reuse_freed_memory`), and ``plan_memory`` with it
    places the large arrays of each step by plan (:mod:`cosmotrain.device.step_memory`).
    On a GPU the convolution
    settings are the device's (:func:`settings_for`).
    """
    if threads is not None:
        configure_threads(threads)
    if reuse_memory:
        reuse_freed_memory()
        if plan_memory:
            step_memory.install()
    if not device.is_gpu:
        return Runtime(device, threads=threads)
    transport = make_transport(device.communication)
    transport.prepare(comm)
    return Runtime(device, transport, PhaseTimers(), settings_for(device), threads)
