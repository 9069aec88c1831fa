"""A LeakyReLU applied by the convolution before it (``Layer.take_activation``) gives the
bits of its own pass, on every kernel path, and a network trains to the same bits with
the fusion on and off."""

from __future__ import annotations

import numpy as np
import pytest

from cosmotrain.config.schema import ModelConfig
from cosmotrain.kernels.cpu import workers as _parallel
from cosmotrain.kernels.compiled import (avgpool as avgpool_compiled, choice as compiled_choice,
                                          direct)
from cosmotrain.kernels import conv3d
from cosmotrain.kernels.cpu import conv_gemm
from cosmotrain.kernels import pool3d
from cosmotrain.kernels.pool_activation import avg_pool_leaky_backward
from cosmotrain.kernels.activation import leaky_relu_backward, leaky_relu_forward
from cosmotrain.kernels.loss import mse_backward
from cosmotrain.models import build_model
from cosmotrain.nn import containers
from cosmotrain.nn.layers import Conv3d, LeakyReLU, Pool3d
from cosmotrain.nn.module import Context, Parameter
from cosmotrain.precision import narrow, widen

SLOPE = 0.01
# (input shape, filters, dtype, compiled loops on): named after the kernel each reaches
# with the AVX-512 loops; elsewhere they run whatever kernel they reach, still checked.
PATHS = {
    "winograd-f4": ((1, 16, 6, 5, 40), 16, np.float32, True),
    "winograd-f2": ((2, 16, 4, 8, 9), 20, np.float32, True),
    "direct": ((1, 4, 5, 4, 64), 12, np.float32, True),
    "lowered": ((2, 6, 5, 7, 9), 5, np.float32, False),
    "depth-windows": ((1, 4, 4, 40, 40), 8, np.float32, False),
    "float64": ((2, 3, 5, 6, 7), 4, np.float64, True),
}


def _case(shape, filters, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal((filters, shape[1], 3, 3, 3)) * 0.2).astype(dtype)
    bias = rng.standard_normal(filters).astype(dtype)
    return x, w, bias


@pytest.fixture
def two_workers():
    _parallel.set_num_workers(2)
    yield
    _parallel.set_num_workers(None)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_activation_is_the_separate_pass_bit_for_bit(path, with_bias, monkeypatch,
                                                           two_workers) -> None:
    shape, filters, dtype, loops = PATHS[path]
    monkeypatch.setattr(compiled_choice, "USE_DIRECT", loops)
    x, w, bias = _case(shape, filters, dtype)
    b = bias if with_bias else None
    separate = leaky_relu_forward(conv3d.conv3d_forward(x, w, 1, 1, bias=b), SLOPE)
    fused = conv3d.conv3d_forward(x, w, 1, 1, bias=b, activation=SLOPE)
    assert (separate < 0).any() and (separate > 0).any()  # both branches taken
    np.testing.assert_array_equal(fused, separate)


def test_each_named_path_takes_its_kernel() -> None:
    """The cases above reach the kernels they are named after with the AVX-512 loops."""
    if direct.instruction_set() != "avx512":
        pytest.skip("the cases are sized for the AVX-512 loops' register runs")
    from cosmotrain.kernels.geometry import ConvGeometry
    for path in ("winograd-f4", "winograd-f2", "direct"):
        shape, filters, dtype, _ = PATHS[path]
        geo = ConvGeometry.create(shape, (filters, shape[1], 3, 3, 3), 1, 1)
        kernel = compiled_choice.forward_kernel(geo, dtype)
        assert kernel == path.split("-")[0], (path, kernel)
        if kernel == "winograd":
            assert compiled_choice.winograd_tile(geo) == int(path[-1])
    geo = ConvGeometry.create(PATHS["depth-windows"][0], (8, 4, 3, 3, 3), 1, 1)
    assert conv_gemm._thin(geo)


def test_fused_activation_in_bf16_rounds_as_the_separate_layers() -> None:
    """bf16: the convolution's bf16 output, then the activation on it (not on float32)."""
    x, w, _ = _case((1, 3, 5, 6, 7), 4, np.float32)
    xb, wb = narrow(x), narrow(w)
    separate = leaky_relu_forward(conv3d.conv3d_forward(xb, wb, 1, 1), SLOPE)
    fused = conv3d.conv3d_forward(xb, wb, 1, 1, activation=SLOPE)
    np.testing.assert_array_equal(widen(fused), widen(separate))


@pytest.mark.parametrize("width, loops", [(64, True), (60, True), (9, False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_activation_backward_in_the_filter_gradient_is_its_own_pass_bit_for_bit(
        width, loops, with_bias, monkeypatch, two_workers) -> None:
    """The first convolution runs the next LeakyReLU's backward: in the direct loops'
    packing of dy (rows of whole vectors: 64), else (60: padded rows; the lowerings) as
    the activation's own pass first; the same bits either way."""
    monkeypatch.setattr(compiled_choice, "USE_DIRECT", loops)
    x, w, bias = _case((2, 4, 5, 4, width), 12, np.float32)
    y = conv3d.conv3d_forward(x, w, 1, 1, activation=SLOPE)
    dy = np.random.default_rng(3).standard_normal(y.shape).astype(np.float32)
    fn = conv3d.conv3d_backward_filter_bias if with_bias else conv3d.conv3d_backward_filter
    expected = fn(x, leaky_relu_backward(dy.copy(), y, SLOPE), w.shape, 1, 1)
    fused = fn(x, dy.copy(), w.shape, 1, 1, activation=(y, SLOPE))
    for got, want in zip(fused if with_bias else [fused], expected if with_bias else [expected]):
        np.testing.assert_array_equal(got, want)


def _train_step(model, x, y):
    ctx = Context(training=True, global_batch=x.shape[0])
    pred = model.forward(x.copy(), ctx)
    model.backward(mse_backward(pred, y, pred.size), ctx)
    grads = {name: p.grad.copy() for name, p in model.named_parameters()}
    for _, p in model.named_parameters():
        p.grad = None
    return pred, grads


@pytest.mark.parametrize("name, width", [("cosmoflow", 32), ("tiny", 13)])
def test_network_trains_to_the_same_bits_with_and_without_fusion(name, width, monkeypatch,
                                                                  two_workers) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, width, width, width)).astype(np.float32)
    y = rng.standard_normal((2, 4)).astype(np.float32)
    results, backwards, activations = {}, [], []
    forward = conv3d.conv3d_forward
    monkeypatch.setattr(conv3d, "conv3d_forward", lambda *a, activation=None, **k: (
        activations.append(activation) or forward(*a, activation=activation, **k)))
    original = LeakyReLU.backward
    monkeypatch.setattr(LeakyReLU, "backward",
                        lambda self, dy, ctx: backwards.append(self.name) or original(self, dy,
                                                                                     ctx))
    for fuse in (False, True):
        monkeypatch.setattr(containers, "FUSE_ACTIVATIONS", fuse)
        model = build_model(ModelConfig(name=name, width=width), seed=0)
        backwards.clear()
        results[fuse] = _train_step(model, x, y)
        acts = [n for n, layer in model.named_layers() if isinstance(layer, LeakyReLU)]
        pooled = _followed_by_average_pooling(model)
        # fused: conv1 (no input gradient) runs act1's backward, an average pooling runs
        # the backward of the activation before it, the others run their own
        kept = [n for n in acts[::-1] if n != "act1" and n not in pooled]
        assert acts[0] == "act1" and backwards == (kept if fuse else acts[::-1])
        assert not fuse or name != "cosmoflow" or {"act2", "act3"} <= pooled
        # every convolution of both models is followed by a LeakyReLU: all fused
        assert activations == [SLOPE if fuse else None] * len(activations) and activations
        activations.clear()
    (pred0, grads0), (pred1, grads1) = results[False], results[True]
    np.testing.assert_array_equal(pred1, pred0)
    assert grads0.keys() == grads1.keys()
    for key in grads0:
        np.testing.assert_array_equal(grads1[key], grads0[key], err_msg=key)


def _followed_by_average_pooling(model) -> set:
    """Names of the LeakyReLU layers whose next layer is an average pooling."""
    found = set()
    for layer in model.layers():
        items = getattr(layer, "items", [])
        for act, follower in zip(items, items[1:]):
            if (isinstance(act, LeakyReLU) and isinstance(follower, Pool3d)
                    and follower.mode == "avg"):
                found.add(act.name)
    return found


def test_pooling_runs_the_activation_backward_before_it_bit_for_bit(monkeypatch) -> None:
    """An average pooling after a LeakyReLU (whose convolution needs an input gradient)
    runs the activation's backward as it writes its gradient: the bits of the two passes,
    with the compiled loops and without, and on a strided y."""
    rng = np.random.default_rng(4)
    pooling = ((3, 3, 3), (2, 2, 2), ((1, 1),) * 3)
    y = leaky_relu_forward(rng.standard_normal((2, 3, 9, 8, 20)).astype(np.float32), SLOPE)
    dy = rng.standard_normal((2, 3, 5, 4, 10)).astype(np.float32)
    for compiled_loops in (True, False):
        monkeypatch.setattr(avgpool_compiled, "USE_COMPILED", compiled_loops)
        expected = leaky_relu_backward(pool3d.avg_pool3d_backward(dy, y.shape, *pooling), y,
                                       SLOPE)
        np.testing.assert_array_equal(avg_pool_leaky_backward(dy, y, SLOPE, *pooling),
                                      expected)
    wide = np.zeros((2, 3, 9, 8, 24), np.float32)
    wide[..., :20] = y
    np.testing.assert_array_equal(avg_pool_leaky_backward(dy, wide[..., :20], SLOPE, *pooling),
                                  expected)


def test_fusion_holds_for_one_forward_only() -> None:
    """A fusion is asked for before each forward and spent by it: a later call outside a
    Sequential (or a changed layer order) applies no stale activation."""
    conv = Conv3d(name="c", in_channels=1, out_channels=1)
    conv.params["weight"] = Parameter(np.ones((1, 1, 3, 3, 3)))
    assert conv.take_activation(0.1) and conv._activation == 0.1
    assert not conv.take_activation(None) and conv._activation is None
    assert not conv.take_activation(1.5)  # outside [0, 1]: the activation's own error
    x = -np.ones((1, 1, 3, 3, 3))
    conv.take_activation(0.1)
    assert conv.forward(x, Context())[0, 0, 1, 1, 1] == pytest.approx(-2.7)
    assert conv._activation is None
    assert conv.forward(x, Context())[0, 0, 1, 1, 1] == -27.0
    act = LeakyReLU(name="a", slope=0.1)
    act.set_applied_by_previous(True)
    v = np.array([-1.0, 2.0])
    assert act.forward(v, Context()) is v and v[0] == -1.0  # applied before: untouched
    np.testing.assert_array_equal(act.forward(v, Context()), [-0.1, 2.0])  # spent


def test_an_average_pooling_after_a_layer_that_is_no_activation_runs_alone() -> None:
    """conv -> avg pool (no LeakyReLU between): the pooling asks the convolution for an
    activation's backward, gets none, and the gradients are those of the layers apart."""
    from cosmotrain.nn import factory
    from cosmotrain.nn.containers import Sequential
    from cosmotrain.nn.layers import Pool3d as Pool

    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 2, 6, 6, 6), dtype=np.float32)
    conv = factory.conv("conv", 2, 3, 3, 1, 1)
    pool = Pool(name="pool", mode="avg", kernel=(2, 2, 2), stride=(2, 2, 2),
                padding=((0, 0),) * 3)
    ctx = Context(training=True, step=0, seed=0)
    net = Sequential(name="n", items=[conv, pool])
    dy = np.ones_like(net.forward(x, ctx))
    net.backward(dy, ctx)
    alone = factory.conv("conv", 2, 3, 3, 1, 1)
    alone.params["weight"].data[...] = conv.params["weight"].data
    pooled = Pool(name="pool", mode="avg", kernel=(2, 2, 2), stride=(2, 2, 2),
                  padding=((0, 0),) * 3)
    pooled.forward(alone.forward(x, ctx), ctx)
    alone.backward(pooled.backward(dy, ctx), ctx)
    np.testing.assert_array_equal(conv.params["weight"].grad, alone.params["weight"].grad)
