"""Issue 35's byte budget on the CPU: what the stand-in counts per launch, the compulsory
traffic derived from the layer shapes, and the measured ratio of a steady-state GPU
step (both networks, W = 32, batch 1) guarded against regressions.

The W = 128 figures (benchmarks/bench_bytes.py: within 2x for both networks in fp32
and bf16) and the derivation are in docs/PERFORMANCE.md, "GPU: compulsory traffic".
At W = 32 the per-step parameter traffic weighs more (the paper network in bf16 is at
2.1x); the guard pins today's figures, not the target.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from byte_budget import measure
from compulsory_traffic import (Conv, conv_sample_bytes, network_traffic, parameter_bytes,
                                step_traffic)
from conftest import REPO, subprocess_env
from standin import installed
from standin_bytes import kernel_parameters

from cosmotrain.kernels import conv3d
from cosmotrain.kernels.cuda import raw

# (network, precision) -> (bytes moved / compulsory, launches) of a steady-state step at
# W = 32, batch 1, measured 2026-11-29; a change that moves more bytes or launches more
# kernels fails here: lower these when a change improves them.  The six launches added
# for the CUDA graph (the step count and hyperparameters written by launches, the vote
# vector copied from them, the gradient flag kept in place, copies by ravel now counted)
# are what makes the step capturable; a captured step issues them around one graph
# launch (tests/test_cuda_graph.py).
RECORDED = {("cosmoflow", "fp32"): (1.268, 123), ("cosmoflow", "bf16"): (2.096, 180),
            ("mlperf", "fp32"): (1.212, 148), ("mlperf", "bf16"): (1.838, 211)}
MARGIN = 1.02


def test_compulsory_traffic_of_one_block_by_hand() -> None:
    """A 2 -> 4 channel block at 4^3 (x 128 values, y 256, pooled 32), float32."""
    avg = Conv(2, 4, pool="avg")
    # forward x + y, pool y + P; backward dP + dY, mask Y, wgrad X + dY (first: no dgrad)
    assert conv_sample_bytes(avg, 4, 4, first=True) == (128 + 256 + 256 + 32
                                                         + 32 + 256 + 256 + 128 + 256) * 4
    top = Conv(2, 4, pool="max", bias=True)
    # the mask is the pooled activation, dgrad reads dY and writes dX, int8 argmax twice
    assert conv_sample_bytes(top, 4, 4, first=False) == (
        (128 + 256 + 256 + 32 + 32 + 256 + 32 + 256 + 128 + 128 + 256) * 4 + 2 * 32)
    # reads by forward and dgrad, gradient write, SGD: w, g, m read, w, m written
    assert parameter_bytes(10, 4, True) == 10 * (4 + 4 + 4 + 4 + 4 + 4 + 4 + 4)
    assert parameter_bytes(10, 2, False) == 10 * (2 + 2 + 4 + 2 + 4 + 4 + 4 + 2)
    traffic = step_traffic([avg], 4, 4)
    assert traffic.total(3) == 3 * (conv_sample_bytes(avg, 4, 4, True) + 3 * 4 * 4) + \
        parameter_bytes(2 * 4 * 27, 4, False)


def test_paper_network_against_the_published_estimate() -> None:
    """Issue 35's notes: about 620 MB per sample in bf16 at 128^3, 73% in conv1's
    block.  This derivation gives 551 MB and 70% (docs/PERFORMANCE.md says why)."""
    traffic = network_traffic("cosmoflow", 128, 2)
    per_sample = sum(traffic.per_sample.values())
    assert 0.85 * 620e6 < per_sample < 620e6
    assert 0.65 < traffic.per_sample["conv1"] / per_sample < 0.75


def test_raw_kernels_read_const_and_write_the_rest() -> None:
    params = kernel_parameters()
    assert set(params) == set(raw.KERNELS)
    assert all(len(params[k]) == len(codes) for k, (_, codes) in raw.KERNELS.items())
    # mse(const T* pred, const float* target, T* grad, i64 n, float, double* sum, int* nf)
    assert params["mse_bf16"] == (False, False, True, False, False, True, True)


def test_bytes_of_each_kind_of_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    with installed(monkeypatch) as cupy:
        a = cupy.asarray(np.ones((4, 8), np.float32))
        cupy.ledger.take()
        cupy.reshape(a, (8, 4))  # a view
        cupy.empty((4, 8), np.float32)  # an allocation
        b = cupy.add(a, a)  # reads its operands, writes its result
        a[1:3] = b[0]  # reads the value, writes the selected rows
        cupy.multiply(a, 2, out=a)  # in place
        moved = [(launch.read, launch.written) for launch in cupy.ledger.take().launches]
        assert moved == [(0, 0), (0, 0), (256, 128), (32, 64), (128, 128)]


def test_the_activation_gradient_is_applied_on_the_device_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's packed LeakyReLU backward is for numpy arrays only: a device array (the
    stand-in's is an ndarray subclass) gets its own pass, so dW equals the CPU's."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 4, 32, 32, 32)).astype(np.float32)  # conv1 at W = 32
    dy = rng.normal(size=(1, 16, 32, 32, 32)).astype(np.float32)
    y = rng.normal(size=dy.shape).astype(np.float32)
    expected = conv3d.conv3d_backward_filter(x, dy.copy(), (16, 4, 3, 3, 3), 1, 1,
                                             activation=(y, 0.01))
    with installed(monkeypatch) as cupy:
        found = conv3d.conv3d_backward_filter(
            cupy.asarray(x), cupy.asarray(dy), (16, 4, 3, 3, 3), 1, 1,
            activation=(cupy.asarray(y), 0.01),
            settings=conv3d.ConvSettings(algorithm="gemm"))
        with cupy.ledger.paused():
            np.testing.assert_allclose(cupy.asnumpy(found), expected, rtol=1e-4,
                                       atol=1e-3)  # float32 sums of 32768 terms


@pytest.mark.parametrize("network, precision", sorted(RECORDED))
def test_byte_budget_of_a_steady_state_step(network: str, precision: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    found = measure(monkeypatch, network, 32, precision)
    ratio, launches = RECORDED[network, precision]
    print(network, precision, f"ratio {found.ratio:.3f}", f"launches {found.launches}",
          found.heaviest(6))
    assert 1.0 <= found.ratio <= ratio * MARGIN  # never below what cannot be avoided
    assert found.launches <= launches


def test_the_benchmark_prints_its_table() -> None:
    """benchmarks/bench_bytes.py (the W = 128 figures), here at W = 16, in a process of
    its own: a row with the ratio and the launches, and the heaviest kernels."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_bytes.py"),
                           "--width", "16", "--networks", "cosmoflow", "--precisions",
                           "fp32"], capture_output=True, text=True, env=subprocess_env(),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| cosmoflow"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["cosmoflow", "fp32", "16", "1"] and float(cells[6]) >= 1.0
    assert int(cells[7]) > 0 and "sgd_momentum_multi" in done.stdout
