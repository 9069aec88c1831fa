"""The transports (``cosmotrain/comm/transport/``) without a GPU.

* numpy arrays: every call hands MPI the caller's own array (no copy, no staging), and
  bfloat16 travels as a uint16 view of the same memory;
* the staging and CUDA-aware paths run on fake "device" arrays (a numpy subclass with
  fake pinned memory, copies and streams), over real MPI on 2 ranks: every collective
  and a halo exchange give the numpy results, and staging goes through host copies with
  one synchronisation before MPI.  NCCL needs a GPU (``tests/test_gpu_engine.py``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
from conftest import abort_on_error

from cosmotrain.comm.transport import displacements
from cosmotrain.comm.transport import make_transport as DeviceBuffers
from cosmotrain.precision import bfloat16


class Recording:
    """A communicator that records the buffers it is handed and delegates to a real one."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.calls = comm, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.comm, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return method(*args, **kwargs)

        return call


def buffers(args: tuple) -> list[np.ndarray]:
    """The arrays among MPI call arguments (bare or in [array, (counts, displs)] specs)."""
    found = []
    for arg in args:
        if isinstance(arg, np.ndarray):
            found.append(arg)
        elif isinstance(arg, list) and arg and isinstance(arg[0], np.ndarray):
            found.append(arg[0])
    return found


def test_numpy_arrays_go_to_mpi_as_they_are() -> None:
    from mpi4py import MPI

    comm, transport = Recording(MPI.COMM_SELF), DeviceBuffers("staging")
    send = np.arange(6, dtype=np.float32)
    recv = np.empty(6, np.float32)
    transport.allgatherv(comm, send, recv, [6])
    transport.alltoallv(comm, send, [6], recv, [6])
    transport.reduce_scatter(comm, send, recv, [6])
    transport.allreduce(comm, send)
    transport.wait([transport.iallreduce(comm, send)])
    batch = transport.exchange(comm, send)
    batch.recv((6,), np.float32, 0, 3)
    batch.send(send, 0, 3)
    batch.start()
    (received,) = batch.wait()
    np.testing.assert_array_equal(received, send)
    handed = [b for _, args in comm.calls for b in buffers(args)]
    assert all(b is send or b is recv or b is received for b in handed)
    assert {name for name, _ in comm.calls} == {"Allgatherv", "Alltoallv", "Reduce_scatter",
                                                "Allreduce", "Iallreduce", "Irecv", "Isend"}
    if "cupy" not in sys.modules:
        assert transport._ops is None  # nothing device-side was ever touched


def test_bfloat16_travels_as_its_bit_patterns() -> None:
    from mpi4py import MPI

    comm, transport = Recording(MPI.COMM_SELF), DeviceBuffers()
    send = np.linspace(-2, 2, 8).astype(bfloat16())
    recv = np.zeros(8, bfloat16())
    transport.allgatherv(comm, send, recv, [8])
    np.testing.assert_array_equal(recv.astype(np.float32), send.astype(np.float32))
    (sent, got) = buffers(comm.calls[0][1])
    assert sent.dtype == np.uint16 and np.shares_memory(sent, send)
    assert got.dtype == np.uint16 and np.shares_memory(got, recv)
    with pytest.raises(TypeError, match="widen bfloat16"):
        transport.allreduce(comm, send)
    with pytest.raises(ValueError, match="communication mode"):
        DeviceBuffers("gloo")
    assert displacements([2, 0, 3]) == [0, 2, 2]


class FakeDevice(np.ndarray):
    """A "device" array: a numpy array of its own type, so the layer can tell it apart."""


class FakeEvent:
    done = True


class FakeOps:
    """Device operations on :class:`FakeDevice` arrays, counting copies and syncs."""

    def __init__(self) -> None:
        self.counts = {"to_host": 0, "to_device": 0, "synchronize": 0}

    def is_device(self, array: Any) -> bool:
        return isinstance(array, FakeDevice)

    def empty(self, shape: Any, dtype: Any) -> FakeDevice:
        return np.empty(tuple(shape), dtype).view(FakeDevice)

    def pinned(self, shape: Any, dtype: Any) -> np.ndarray:
        return np.empty(tuple(shape), dtype)

    def contiguous(self, array: Any) -> FakeDevice:
        return np.ascontiguousarray(array).view(FakeDevice)

    def to_host(self, device: Any, host: Any) -> None:
        assert type(host) is np.ndarray and device.flags.c_contiguous
        self.counts["to_host"] += 1
        host[...] = device

    def to_device(self, host: Any, device: Any) -> None:
        assert isinstance(device, FakeDevice) and device.flags.c_contiguous
        self.counts["to_device"] += 1
        device[...] = host

    def synchronize(self) -> None:
        self.counts["synchronize"] += 1

    def event(self) -> FakeEvent:
        return FakeEvent()

    def copy(self, source: Any, target: Any) -> None:
        target[...] = source


def device(array: np.ndarray) -> FakeDevice:
    return np.array(array).view(FakeDevice)


def run_collectives(comm: Any, transport: DeviceBuffers, wrap: Any) -> dict[str, np.ndarray]:
    """Every collective and one exchange on 2 ranks with uneven pieces; plain results."""
    rank = comm.Get_rank()
    rng = np.random.default_rng(rank)
    out = {}
    counts = [3, 5]
    send = wrap(rng.normal(size=counts[rank]))
    recv = wrap(np.zeros(sum(counts)))
    transport.allgatherv(comm, send, recv, counts)
    out["allgatherv"] = np.asarray(recv)
    partial = wrap(rng.normal(size=8))
    mine = wrap(np.zeros(counts[rank]))
    transport.reduce_scatter(comm, partial, mine, counts)
    out["reduce_scatter"] = np.asarray(mine)
    send_counts, recv_counts = [[1, 4], [2, 3]][rank], [[1, 2], [4, 3]][rank]
    outgoing = wrap(rng.normal(size=sum(send_counts)).astype(np.float32))
    incoming = wrap(np.zeros(sum(recv_counts), np.float32))
    transport.alltoallv(comm, outgoing, send_counts, incoming, recv_counts)
    out["alltoallv"] = np.asarray(incoming)
    bucket = wrap(rng.normal(size=7))
    sums = wrap(rng.normal(size=(2, 3)))
    pending = transport.iallreduce(comm, bucket)
    transport.allreduce(comm, sums)
    transport.wait([pending])
    out["iallreduce"], out["allreduce"] = np.asarray(bucket), np.asarray(sums)
    block = wrap(rng.normal(size=(2, 3, 4)).astype(bfloat16()))
    batch = transport.exchange(comm, block)
    batch.recv((2, 3, 2), bfloat16(), 1 - rank, 7)
    batch.send(block[:, :, 1:3], 1 - rank, 7)
    batch.start()
    (got,) = batch.wait()
    out["exchange"] = np.asarray(got).astype(np.float32)
    partial = rng.normal(size=8)  # in place: rank r's sums at the start of its buffer
    summed, blocking = wrap(partial.copy()), wrap(np.zeros(counts[rank]))
    transport.wait([transport.ireduce_scatter(comm, summed, counts)])
    transport.reduce_scatter(comm, wrap(partial.copy()), blocking, counts)
    out["ireduce_scatter"] = np.asarray(summed[:counts[rank]])
    out["ireduce_scatter as blocking"] = np.asarray(blocking)
    gathered = wrap(np.zeros(8))  # in place: rank r's piece at its displacement
    start = displacements(counts)[rank]
    gathered[start:start + counts[rank]] = rank + 1.0
    transport.wait([transport.iallgatherv(comm, gathered, counts)])
    out["iallgatherv"] = np.asarray(gathered)
    out["device"] = np.array([isinstance(a, FakeDevice) for a in (recv, mine, incoming,
                                                                  bucket, sums, got,
                                                                  summed, gathered)])
    return out


def halo_round_trip(comm: Any, transport: DeviceBuffers, wrap: Any) -> list[np.ndarray]:
    """Forward and backward halo exchanges of a D2 grid through ``transport``."""
    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.runtime.job_runtime import Runtime
    from cosmotrain.config.layout import Layout as ParallelLayout
    from cosmotrain.tensor.distribution import Distribution
    from cosmotrain.tensor.halo import HaloExchange
    from cosmotrain.tensor.windows import halo_plans, spatial_halos

    grid = ProcessGrid(comm, ParallelLayout(1, depth=2))
    dist = Distribution((1, 2, 7, 5, 4), (1, 1, 2, 1, 1))
    halos = spatial_halos(dist, (3, 3, 3), (1, 1, 1), ((1, 1),) * 3)
    plans = tuple(halo_plans(h)[c] for h, c in zip(halos, grid.spatial_coords))
    exchange = HaloExchange(grid, plans, Runtime(transport=transport))
    rng = np.random.default_rng(3 + comm.Get_rank())
    shape = (1, 2) + exchange.buffer_shape
    forward, backward = wrap(rng.normal(size=shape)), wrap(rng.normal(size=shape))
    exchange.exchange(forward, "replace")
    exchange.exchange(backward, "add")
    grid.free()
    return [np.asarray(forward), np.asarray(backward)]


@pytest.mark.parallel(nprocs=2)
@abort_on_error
def test_staging_and_cuda_aware_paths_give_the_numpy_results() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    expected = run_collectives(world, DeviceBuffers(), np.array)
    halo = halo_round_trip(world, DeviceBuffers(), np.array)
    failures = []
    if not np.array_equal(expected["ireduce_scatter"], expected["ireduce_scatter as blocking"]):
        failures.append("in-place ireduce_scatter differs from reduce_scatter")
    if not np.array_equal(expected["iallgatherv"], [1, 1, 1, 2, 2, 2, 2, 2]):
        failures.append(f"in-place iallgatherv gave {expected['iallgatherv']}")
    for mode in ("staging", "cuda-aware"):
        ops = FakeOps()
        transport = DeviceBuffers(mode, ops)
        got = run_collectives(world, transport, device)
        for key, value in expected.items():
            if key != "device" and not np.array_equal(got[key], value):
                failures.append(f"{mode} {key}")
        if not got["device"].all():
            failures.append(f"{mode}: results left the device {got['device']}")
        staged = ops.counts["to_host"] + ops.counts["to_device"]
        if (mode == "staging") != (staged > 0) or ops.counts["synchronize"] == 0:
            failures.append(f"{mode}: copies/syncs {ops.counts}")
        for a, b in zip(halo_round_trip(world, transport, device), halo):
            if not np.array_equal(a, b):
                failures.append(f"{mode} halo exchange")
    failures = sorted(set(sum(world.allgather(failures), [])))
    assert not failures, failures
