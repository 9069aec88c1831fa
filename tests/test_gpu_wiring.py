"""The kernel front doors send device arrays to our CUDA kernels (issue 35, item 3).

On the stand-in cupy (tests/standin.py, our ``.cu`` sources run by their host build)
each front door is checked against the CPU path on the same values: float32 bit for bit
(the loss sum to float64 rounding: loss.cu adds in its own order), bf16 within one
rounding, with bf16 read and written as stored: one launch of our kernel, no widening
or narrowing pass (``astype``) around it.  The step's use of them is counted in
tests/test_gpu_step_counts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from standin import installed

from cosmotrain.device.xp import to_host
from cosmotrain.kernels import activation, dropout, loss

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPE = (2, 3, 4, 5, 6)
SLOPE = 0.3  # (1 - slope) + slope is not 1 in float32: the backward's factors matter


def values(dtype: Any, seed: int = 0, shape: tuple = SHAPE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape).astype(np.float32).astype(dtype)


def front_doors(dtype: Any) -> dict[str, tuple[Callable, tuple]]:
    """name -> (call, host arguments): every wired front door on one set of values (the
    bias in the activations' dtype, as ``Parameter.like`` hands it to the convolution)."""
    x, dy, bias = values(dtype, 1), values(dtype, 2), values(dtype, 3, (SHAPE[1],))
    pred, target = values(dtype, 4, (6, 4)), values(np.float32, 5, (6, 4))
    geometry = ((2, 0, 0, 0, 0), (5, *SHAPE[1:]))

    def mask(x: Any) -> Any:
        return dropout.dropout_mask(x, *geometry, 0.4, 11, 3, 7)
    return {
        "forward": (lambda x: activation.leaky_relu_forward(x, SLOPE), (x,)),
        "backward": (lambda dy, y: activation.leaky_relu_backward(dy, y, SLOPE), (dy, x)),
        "epilogue": (lambda y, b: activation.bias_leaky_relu(y, b, SLOPE), (x, bias)),
        "bias only": (lambda y, b: activation.bias_leaky_relu(y, b, None), (x, bias)),
        "dropout": (lambda x: dropout.dropout_forward(x, mask(x), 0.4), (x,)),
        "dropout backward": (lambda dy: dropout.dropout_backward(dy, mask(dy), 0.4), (dy,)),
        "mse": (lambda p, t: loss.total_and_grad("mse", p, t, 96), (pred, target)),
    }


def on_host(name: str, dtype: Any) -> Any:
    call, args = front_doors(dtype)[name]
    return call(*(a.copy() for a in args))


def on_standin(name: str, dtype: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list]:
    """The front door's results on the stand-in device, and its launches."""
    call, args = front_doors(dtype)[name]
    with installed(monkeypatch) as cupy:
        device = [cupy.asarray(a) for a in args]
        cupy.ledger.take()
        out = call(*device)
        launches = cupy.ledger.take().launches
        return ([to_host(o) for o in out] if isinstance(out, tuple) else to_host(out)), launches


KERNELS = {"forward": "bias_leaky_relu", "backward": "leaky_relu_backward",
           "epilogue": "bias_leaky_relu", "bias only": "bias_leaky_relu",
           "dropout": "dropout", "dropout backward": "dropout", "mse": "mse"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_float32_device_front_doors_give_the_cpu_bits(name: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    device, launches = on_standin(name, np.float32, monkeypatch)
    host = on_host(name, np.float32)
    launched = [launch.kernel for launch in launches]
    assert f"{KERNELS[name]}_f32" in launched and "astype" not in launched, launched
    if name == "mse":  # (sum, gradient): the sum in the kernel's order
        np.testing.assert_allclose(device[0], host[0], rtol=1e-14)
        np.testing.assert_array_equal(device[1], host[1])
    else:
        np.testing.assert_array_equal(device, host)
        assert device.dtype == np.float32


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_bf16_device_front_doors_are_one_native_launch(name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 storage is read and written as stored: one launch of our kernel and no
    astype of an activation (the epilogue widens the (C,) bf16 bias, exactly; the loss
    zeroes its two device scalars), within one bf16 rounding of the CPU's widened path
    (which rounds the biased value before the activation rounds it again)."""
    device, launches = on_standin(name, BF16, monkeypatch)
    host = on_host(name, BF16)
    work = [launch.kernel for launch in launches if launch.kernel not in ("zeros", "empty_like")
            and not (launch.kernel == "astype" and len(launch.signature[0][0][0]) == 1)]
    assert work == [f"{KERNELS[name]}_bf16"], work
    if name == "mse":
        np.testing.assert_allclose(device[0], host[0], rtol=1e-14)
        device, host = device[1], host[1]
    assert device.dtype == BF16
    np.testing.assert_allclose(device.astype(np.float32), host.astype(np.float32),
                               rtol=2.0 ** -7, atol=0)


def test_strided_device_arrays_keep_the_fused_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A halo buffer's owned planes are a strided view: the element-wise cupy kernel
    writes them in place (ours take contiguous arrays), with the same values."""
    dy, y = values(np.float32, 1, (2, 3, 6, 5, 6)), values(np.float32, 2, (2, 3, 4, 5, 6))
    expected = activation.leaky_relu_backward(dy.copy()[:, :, 1:5], y, SLOPE, inplace=False)
    with installed(monkeypatch) as cupy:
        buffer = cupy.asarray(dy)
        owned = buffer[:, :, 1:5]
        cupy.ledger.take()
        activation.leaky_relu_backward(owned, cupy.asarray(y), SLOPE)
        launched = [launch.kernel for launch in cupy.ledger.take().launches]
        assert launched == ["cosmotrain_leaky_relu_backward"], launched  # in place
        np.testing.assert_allclose(to_host(buffer)[:, :, 1:5], expected, rtol=1e-6)
