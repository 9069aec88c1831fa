"""The per-job runtime: what a job's builders need beyond the grid's topology.

A :class:`Runtime` is built once when a job is built (:func:`build_runtime`, after the
device is selected and the grid exists) and handed to the builders: the distributed
layers, the halo exchanges and the gradient reducer take their transport and phase
timers from it, never from the :class:`~cosmotrain.comm.grid.ProcessGrid`, which is
pure topology.  The default ``Runtime()`` is the host's: the numpy pass-through
transport, fresh timers, the default convolution settings (what a test or a tool that
builds a layer by hand gets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cosmotrain.comm.timers import PhaseTimers
from cosmotrain.device.select import Device
from cosmotrain.device.transport import Transport, make_transport
from cosmotrain.kernels.cuda.settings import ConvSettings, configure, settings_for


@dataclass(frozen=True)
class Runtime:
    """One job's device, transport (how buffers cross MPI), communication timers and
    GPU convolution settings."""

    device: Device = field(default_factory=Device)
    transport: Transport = field(default_factory=make_transport)
    timers: PhaseTimers = field(default_factory=PhaseTimers)
    conv: ConvSettings = field(default_factory=ConvSettings)


def build_runtime(device: Device, comm: Any) -> Runtime:
    """The runtime of a job on ``device`` whose ranks are ``comm`` (the grid's ``cart``;
    collective on a GPU, where the transport follows ``device.communication`` and is
    prepared over ``comm``).

    The GPU convolution kernels still read their settings from
    :mod:`cosmotrain.kernels.cuda.settings`: this is the one place that installs them.
    """
    if not device.is_gpu:
        return Runtime(device)
    conv = settings_for(device)
    configure(conv)
    transport = make_transport(device.communication)
    transport.prepare(comm)
    return Runtime(device, transport, PhaseTimers(), conv)
