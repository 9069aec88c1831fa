"""SGD (momentum) and Adam, with weight decay, against their formulas and torch.optim."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.config.schema import OptimizerConfig
from cosmotrain.nn.module import Parameter
from cosmotrain.engine.optim import SGD, Adam, build_optimizer


def test_sgd_momentum_formula() -> None:
    p = Parameter(np.array([1.0, -2.0], dtype=np.float32))
    opt = SGD(lr=0.1, momentum=0.5, weight_decay=0.0)
    for grad in ([1.0, 1.0], [2.0, 0.0]):
        p.grad = np.array(grad, dtype=np.float32)
        opt.step([("p", p)])
    # v1 = g1 = [1, 1]; v2 = 0.5 v1 + g2 = [2.5, 0.5]; p = p0 - 0.1 (v1 + v2)
    assert np.allclose(p.data, [1.0 - 0.35, -2.0 - 0.15])


def test_weight_decay_adds_decay_times_the_parameter_to_the_gradient() -> None:
    """L2 weight decay, as torch.optim: g + wd * p, here without momentum."""
    p = Parameter(np.array([1.0, -2.0], dtype=np.float32))
    p.grad = np.array([0.5, 0.5], dtype=np.float32)
    SGD(lr=0.1, momentum=0.0, weight_decay=0.2).step([("p", p)])
    # p - 0.1 (g + 0.2 p) = [1 - 0.1 * 0.7, -2 - 0.1 * 0.1]
    assert np.allclose(p.data, [0.93, -2.01])


def test_adam_first_step_moves_by_lr() -> None:
    p = Parameter(np.array([1.0, -2.0], dtype=np.float32))
    p.grad = np.array([3.0, -0.5], dtype=np.float32)
    Adam(lr=0.01).step([("p", p)])
    assert np.allclose(p.data, [0.99, -1.99], atol=1e-6)


def test_adam_keeps_its_moment_arrays_across_steps(monkeypatch) -> None:
    """The moments are allocated once: a zeroed pair per parameter and step would cost a
    write of twice the model's size every step (``dict.setdefault``'s default)."""
    p = Parameter(np.ones(4, dtype=np.float32))
    opt = Adam(lr=0.01)
    p.grad = np.full(4, 0.5, dtype=np.float32)
    opt.step([("p", p)])
    moments = opt.state["p"]["exp_avg"], opt.state["p"]["exp_avg_sq"]
    calls = []
    monkeypatch.setattr(np, "zeros_like", lambda *a, **k: calls.append(a) or None)
    opt.step([("p", p)])
    assert not calls
    assert opt.state["p"]["exp_avg"] is moments[0] and opt.state["p"]["exp_avg_sq"] is moments[1]
    assert opt.state["p"]["step"] == 2


@pytest.mark.parametrize("name, wd", [("sgd", 0.0), ("sgd", 1e-2), ("adam", 0.0),
                                      ("adam", 1e-2)])
def test_matches_torch_optim_over_steps(name: str, wd: float) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    start = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(4)]
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=wd, momentum=0.9)
    ours, p = build_optimizer(cfg), Parameter(start.copy())
    tp = torch.nn.Parameter(torch.from_numpy(start.copy()))
    topt = (torch.optim.SGD([tp], lr=0.05, momentum=0.9, weight_decay=wd) if name == "sgd"
            else torch.optim.Adam([tp], lr=0.05, weight_decay=wd))
    for g in grads:
        p.grad = g.copy()
        ours.step([("p", p)])
        tp.grad = torch.from_numpy(g.copy())
        topt.step()
    assert np.allclose(p.data, tp.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_parameters_without_gradient_are_left_alone() -> None:
    p = Parameter(np.ones(3, dtype=np.float32))
    SGD(lr=1.0).step([("p", p)])
    assert np.array_equal(p.data, np.ones(3))


@pytest.mark.parametrize("name, wd", [("sgd", 0.0), ("sgd", 1e-2), ("adam", 0.0),
                                      ("adam", 1e-2)])
def test_compiled_update_is_the_numpy_update_bit_for_bit(monkeypatch, name, wd) -> None:
    """float32 parameters take the fused loops of kernels/optim_update.py: the same
    values, bit for bit, as the numpy update (one parameter over several chunks, one
    small), over steps; the first momentum step (a copy) included."""
    from cosmotrain.kernels.cpu import workers as _parallel
    from cosmotrain.kernels import optim_update

    if optim_update._loops() is None:
        pytest.skip("the compiled loops were not built")
    monkeypatch.setattr(optim_update, "CHUNK_ELEMENTS", 1000)
    rng = np.random.default_rng(3)
    shapes = {"big": (7, 13, 37), "small": (5,)}
    start = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(4)]
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=wd, momentum=0.9)
    results = {}
    _parallel.set_num_workers(2)
    try:
        for compiled in (True, False):
            monkeypatch.setattr(optim_update, "USE_COMPILED", compiled)
            opt = build_optimizer(cfg)
            params = {k: Parameter(v.copy()) for k, v in start.items()}
            for g in grads:
                for k, p in params.items():
                    p.grad = g[k].copy()
                opt.step(list(params.items()))
            results[compiled] = ({k: p.data for k, p in params.items()}, opt.state)
    finally:
        _parallel.set_num_workers(None)
    for k in shapes:
        assert np.array_equal(results[True][0][k], results[False][0][k]), k
        for slot, value in results[False][1][k].items():
            assert np.array_equal(results[True][1][k][slot], value), (k, slot)
