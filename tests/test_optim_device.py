"""The device step's one-launch optimizer update (``engine/optim_device.py``): the same
bits as ``engine/optim.py`` on the CPU, nothing written where the device flag says
skip.  Run on the stand-in cupy, whose raw launches are the host build of ``optim.cu``."""

from __future__ import annotations

import numpy as np
import pytest
from standin import installed

from cosmotrain.engine.optim import SGD, Adam, Optimizer
from cosmotrain.engine.optim_device import SLOTS, MultiUpdate
from cosmotrain.nn.module import Parameter

SHAPES = [(4, 3, 3), (7,), (2, 5)]


def make(optimizer: type, **hyper: float) -> Optimizer:
    return optimizer(lr=0.01, weight_decay=1e-3, **hyper)


def params(xp: object, seed: int = 0) -> list[tuple[str, Parameter]]:
    rng = np.random.default_rng(seed)
    return [(f"p{i}", Parameter(xp.asarray(rng.normal(size=s).astype(np.float32))))
            for i, s in enumerate(SHAPES)]


def gradients(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_the_multi_tensor_update_has_the_cpu_bits_and_skips_on_the_flag(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hyper = {"momentum": 0.9} if kind == "sgd" else {}
    rule = SGD if kind == "sgd" else Adam
    host, host_opt = params(np), make(rule, **hyper)
    with installed(monkeypatch) as cupy:
        device, device_opt, multi = params(cupy), make(rule, **hyper), MultiUpdate()
        hyper_on_device = cupy.zeros(8, dtype=np.float32)
        for step in range(4):
            skip = step == 2  # a step that may not be applied
            before = [cupy.asnumpy(p.data) for _, p in device]
            for (_, hp), (_, dp), g in zip(host, device, gradients(step)):
                hp.grad, dp.grad = g.copy(), cupy.asarray(g)
            if not skip:
                host_opt.step(host, 0.01 * (step + 1))
            cupy.ledger.take()
            assert multi.apply(device_opt, device, 0.01 * (step + 1),
                               cupy.asarray(np.bool_(skip)), hyper_on_device)
            ledger = cupy.ledger.take()
            kernels = [launch.kernel for launch in ledger.launches]
            assert ledger.syncs == [] and kernels[-1] == f"{rule.__name__.lower()}_multi" \
                .replace("sgd_", "sgd_momentum_")
            assert kernels[:-2] == ["zeros_like"] * len(SHAPES) * len(SLOTS[rule]) * (
                step == 0) + ["put_f32x8"]  # the first step's slots, the hyperparameters
            pointers = len(SHAPES) * (2 + len(SLOTS[rule]))  # the address table: new grads
            assert ledger.uploads[1:] == [((pointers,), "<u8"), ((len(SHAPES) + 1,), "<i8")]
            for (name, hp), (_, dp), old in zip(host, device, before):
                got = cupy.asnumpy(dp.data)
                np.testing.assert_array_equal(got, old if skip else hp.data, err_msg=name)
            if kind == "adam" and skip:  # the host's step count moved on: keep them alike
                for name in host_opt.state:
                    host_opt.state[name]["step"] += 1


def test_what_the_kernels_do_not_take_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with installed(monkeypatch) as cupy:
        device = params(cupy)
        for _, p in device:
            p.grad = cupy.zeros_like(p.data)
        flag = cupy.asarray(np.bool_(False))
        hyper = cupy.zeros(8, dtype=np.float32)
        assert not MultiUpdate().apply(SGD(lr=0.1, momentum=0.0), device, None, flag, hyper)
        half = SGD(lr=0.1, momentum=0.9)
        half.state["p0"] = {"momentum_buffer": cupy.zeros_like(device[0][1].data)}
        assert not MultiUpdate().apply(half, device, None, flag, hyper)  # one "first"
        wide = params(cupy)
        for _, p in wide:
            p.data, p.grad = p.data.astype(np.float64), p.data.astype(np.float64)
        assert not MultiUpdate().apply(SGD(lr=0.1, momentum=0.9), wide, None, flag, hyper)
