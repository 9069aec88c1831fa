"""SGD (momentum) and Adam, with weight decay, against their formulas and torch.optim."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.config.schema import OptimizerConfig
from cosmotrain.nn.module import Parameter
from cosmotrain.train.optim import SGD, Adam, build_optimizer


def test_sgd_momentum_formula() -> None:
    p = Parameter(np.array([1.0, -2.0], dtype=np.float32))
    opt = SGD(lr=0.1, momentum=0.5, weight_decay=0.0)
    for grad in ([1.0, 1.0], [2.0, 0.0]):
        p.grad = np.array(grad, dtype=np.float32)
        opt.step([("p", p)])
    # v1 = g1 = [1, 1]; v2 = 0.5 v1 + g2 = [2.5, 0.5]; p = p0 - 0.1 (v1 + v2)
    assert np.allclose(p.data, [1.0 - 0.35, -2.0 - 0.15])


def test_adam_first_step_moves_by_lr() -> None:
    p = Parameter(np.array([1.0, -2.0], dtype=np.float32))
    p.grad = np.array([3.0, -0.5], dtype=np.float32)
    Adam(lr=0.01).step([("p", p)])
    assert np.allclose(p.data, [0.99, -1.99], atol=1e-6)


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
