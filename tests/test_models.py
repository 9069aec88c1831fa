"""The networks: parameter counts from REFERENCE.md, PyTorch layout, and forward/backward
against an independent oracle (torch.nn's autograd when torch is installed; finite
differences always)."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.config.schema import ModelConfig
from cosmotrain.kernels.loss import mse_backward, mse_sum
from cosmotrain.models import build_model
from cosmotrain.nn.layers import LeakyReLU, Pool3d
from cosmotrain.nn.module import Context


def model_of(name: str, width: int, **kw) -> object:
    return build_model(ModelConfig(name=name, width=width, **kw), seed=3)


def parameter_count(model) -> int:
    return sum(p.data.size for _, p in model.named_parameters())


@pytest.mark.parametrize("width", [128, 256, 512])
def test_cosmoflow_has_the_papers_parameter_count(width: int) -> None:
    assert parameter_count(model_of("cosmoflow", width)) == 9_437_636


def test_mlperf_parameter_count() -> None:
    assert parameter_count(model_of("cosmoflow-mlperf", 128)) == 8_907_556


def test_cosmoflow_names_follow_pytorch() -> None:
    names = [n for n, _ in model_of("cosmoflow", 32, batchnorm=True).named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert names[-2:] == ["fc3.weight", "fc3.bias"]


def test_first_linear_adapts_to_the_width() -> None:
    fc1 = {n: p.shape for n, p in model_of("cosmoflow", 64).named_parameters()}["fc1.weight"]
    assert fc1 == (2048, 256)


def test_initialisation_depends_on_seed_and_name_only() -> None:
    a = dict(model_of("cosmoflow", 32).named_parameters())
    b = dict(build_model(ModelConfig(name="cosmoflow", width=32, batchnorm=True),
                         seed=3).named_parameters())
    assert np.array_equal(a["conv3.weight"].data, b["conv3.weight"].data)
    assert np.all(a["fc1.bias"].data == np.float32(0.1))


def run_step(model, x: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    ctx = Context(training=True, global_batch=x.shape[0])
    pred = model.forward(x, ctx)
    loss = mse_sum(pred, target) / pred.size
    model.backward(mse_backward(pred, target, pred.size), ctx)
    return loss, pred


CASES = [
    ("tiny", 16, {}),
    ("tiny", 12, {"batchnorm": True}),
    ("cosmoflow", 16, {}),
    ("cosmoflow", 32, {"batchnorm": True}),
    ("cosmoflow-mlperf", 32, {}),
    ("resnet3d", 12, {"depth": 10, "base_channels": 4}),
    ("resnet3d", 8, {"depth": 10, "base_channels": 2, "block": "bottleneck"}),
    ("resnet3d", 8, {"depth": 10, "base_channels": 4, "batchnorm": False}),
]


@pytest.mark.parametrize("name, width, kw", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_forward_and_gradients_match_torch(name: str, width: int, kw: dict, dtype: str
                                           ) -> None:
    """float64: tight agreement; float32: within 2e-4 of the largest gradient entry.

    The MLPerf network is checked in float64 only: float32 rounding can flip near-tied
    max-pool winners through its five max pools, which moves single gradient entries.
    """
    torch = pytest.importorskip("torch")
    from torch_mirror import torch_twin

    if dtype == "float32" and name == "cosmoflow-mlperf":
        pytest.skip("near-tied max-pool winners differ at float32 rounding")
    model = model_of(name, width, **kw)
    for _, p in model.named_parameters():
        p.data = p.data.astype(dtype)
    twin = torch_twin(model).to(getattr(torch, dtype))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, width, width, width)).astype(dtype)
    target = rng.uniform(-1, 1, size=(2, 4)).astype(dtype)
    loss, pred = run_step(model, x.copy(), target)
    tpred = twin(torch.from_numpy(x))
    tloss = ((tpred - torch.from_numpy(target)) ** 2).mean()
    tloss.backward()
    tol = 1e-9 if dtype == "float64" else 2e-4
    assert np.allclose(pred, tpred.detach().numpy(), rtol=tol, atol=tol / 10)
    assert loss == pytest.approx(tloss.item(), rel=tol)
    grads = dict(twin.named_parameters())
    for pname, param in model.named_parameters():
        expected = grads[pname].grad.numpy()
        scale = np.abs(expected).max() + 1e-30
        assert np.abs(param.grad - expected).max() / scale < tol, pname


def test_batchnorm_running_statistics_match_torch() -> None:
    torch = pytest.importorskip("torch")
    from torch_mirror import torch_twin

    model = model_of("tiny", 12, batchnorm=True)
    twin = torch_twin(model)
    x = np.random.default_rng(1).normal(size=(3, 4, 12, 12, 12)).astype(np.float32)
    model.forward(x.copy(), Context(training=True))
    twin.train()(torch.from_numpy(x))
    for name, owner, key in model.named_buffers():
        assert np.allclose(owner.buffers[key], twin.state_dict()[name].numpy(), rtol=1e-5)
    evaluated = model.forward(x.copy(), Context(training=False))
    assert np.allclose(evaluated, twin.eval()(torch.from_numpy(x)).detach().numpy(),
                       rtol=1e-4, atol=1e-5)


def test_whole_network_gradient_finite_differences() -> None:
    """float64 end to end: a few parameter entries of every layer of the tiny network."""
    model = model_of("tiny", 8, batchnorm=True)
    for _, p in model.named_parameters():
        p.data = p.data.astype(np.float64)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 4, 8, 8, 8))
    target = rng.uniform(-1, 1, size=(2, 4))
    run_step(model, x.copy(), target)

    def loss_now() -> float:
        pred = model.forward(x.copy(), Context(training=True))
        return mse_sum(pred, target) / pred.size

    for name, p in model.named_parameters():
        for index in list(np.ndindex(p.shape))[:: max(1, p.data.size // 3)][:3]:
            old = p.data[index]
            p.data[index] = old + 1e-6
            up = loss_now()
            p.data[index] = old - 1e-6
            down = loss_now()
            p.data[index] = old
            assert p.grad[index] == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-8), name


def test_mlperf_pools_before_activating_bit_for_bit() -> None:
    """conv -> max-pool -> LeakyReLU is the reference's conv -> LeakyReLU -> max-pool:
    the same prediction and parameter gradients, bit for bit on random float32 data."""
    model, reference = model_of("cosmoflow-mlperf", 32), model_of("cosmoflow-mlperf", 32)
    names = [layer.name for layer in model.items]
    assert names.index("pool1") < names.index("act1")
    for i, layer in enumerate(list(reference.items[:-1])):  # back to the reference order
        if isinstance(layer, Pool3d) and isinstance(reference.items[i + 1], LeakyReLU):
            reference.items[i], reference.items[i + 1] = reference.items[i + 1], layer
    assert [layer.name for layer in reference.items].index("act1") == names.index("pool1")
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 4, 32, 32, 32)).astype(np.float32)
    target = rng.uniform(-1, 1, size=(2, 4)).astype(np.float32)
    loss, pred = run_step(model, x.copy(), target)
    ref_loss, ref_pred = run_step(reference, x.copy(), target)
    assert np.array_equal(pred, ref_pred) and loss == ref_loss
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert np.array_equal(p.grad, q.grad), name


def test_mlperf_against_torch_in_the_reference_order() -> None:
    """The PyTorch network in Keras's order (activation, then pooling), float64."""
    torch = pytest.importorskip("torch")
    from torch_mirror import torch_twin

    model = model_of("cosmoflow-mlperf", 32)
    for _, p in model.named_parameters():
        p.data = p.data.astype(np.float64)
    twin = torch_twin(model, activation_first=True).to(torch.float64)
    assert twin.order.index("act1") < twin.order.index("pool1")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 32, 32, 32))
    target = rng.uniform(-1, 1, size=(2, 4))
    loss, pred = run_step(model, x.copy(), target)
    tloss = ((twin(torch.from_numpy(x)) - torch.from_numpy(target)) ** 2).mean()
    tloss.backward()
    assert loss == pytest.approx(tloss.item(), rel=1e-9)
    grads = dict(twin.named_parameters())
    for pname, param in model.named_parameters():
        expected = grads[pname].grad.numpy()
        assert np.abs(param.grad - expected).max() <= 1e-9 * np.abs(expected).max(), pname


def test_mlperf_negative_slope_keeps_the_reference_order() -> None:
    """max-pool and LeakyReLU commute only for a non-negative slope."""
    names = [layer.name for layer in model_of("cosmoflow-mlperf", 32, leaky_slope=-0.1).items]
    assert names.index("act1") < names.index("pool1")
