"""The stand-in cupy of tests/standin.py counts what it claims to count: a counter that
missed a kind of host read would let tests/test_gpu_step_counts.py pass by blindness."""

from __future__ import annotations

import numpy as np
import pytest
from standin import installed

from cosmotrain.device.xp import is_device_array, to_host
from cosmotrain.kernels.route import route


def test_every_kind_of_host_read_is_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    with installed(monkeypatch) as cupy:
        a = cupy.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
        total = a.sum()
        reads = [lambda: bool(total), lambda: float(total), lambda: int(total),
                 lambda: total.item(), lambda: a.tolist(), lambda: a.get(),
                 lambda: cupy.asnumpy(a), lambda: str(a), lambda: repr(a),
                 lambda: f"{total}", lambda: to_host(a),
                 lambda: cupy.cuda.get_current_stream().synchronize(),
                 lambda: cupy.cuda.Device().synchronize(),
                 lambda: a[0, 1].item()]
        for index, read in enumerate(reads):
            cupy.ledger.take()
            read()
            assert len(cupy.ledger.take().syncs) == 1, index
        cupy.ledger.take()
        b = a[1] * 2 + a[0]  # a view, two launches
        b[0] = total  # a device copy, no read
        queued = np.empty(3, np.float32)
        b.get(out=queued, blocking=False)  # a queued copy, no read
        assert cupy.ledger.syncs == [] and len(cupy.ledger.downloads) == 1
        assert to_host(b).tolist() == queued.tolist() == [15.0, 9.0, 12.0]


def test_launches_allocations_and_uploads(monkeypatch: pytest.MonkeyPatch) -> None:
    with installed(monkeypatch) as cupy:
        a = cupy.asarray(np.ones((4, 5), np.float32))
        assert is_device_array(a) and route(a).device and not is_device_array(np.ones(2))
        assert cupy.ledger.take().uploads == [((4, 5), "<f4")]
        b = a + np.float32(2)
        view = b[1:]
        cupy.multiply(view, 3, out=view)
        ledger = cupy.ledger.take()
        assert [launch.kernel for launch in ledger.launches] == ["add", "multiply"]
        add, multiply = ledger.launches
        assert add.signature[0] == (((4, 5), "<f4"), np.float32(2))
        assert add.addresses[0] == a.__array_interface__["data"][0]
        assert multiply.addresses[-1] == view.__array_interface__["data"][0]
        assert ledger.allocations == [((4, 5), "<f4")]  # b; the view and out= allocate none
        assert isinstance(b, cupy.ndarray) and isinstance(view, cupy.ndarray)
