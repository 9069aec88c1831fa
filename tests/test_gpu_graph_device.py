"""The training step captured as a CUDA graph on a real device (engine/cuda_graph.py):
what the stand-in cannot show (tests/test_cuda_graph.py runs the same logic on the CPU).
Needs cupy, cuDNN and a visible CUDA device; skipped cleanly anywhere else.

* cupy really captures the step: cuDNN bound to the capture stream, our raw kernels,
  the dense head's kernels, the pinned copies of the update's address table, under a
  private pool (the capture happens: ``StepGraph.replaying``);
* replays train as the eager step of the same job does, with a learning rate and a
  dropout mask that change every step: the losses and parameters agree to float32
  rounding of another summation order (1e-5 relative), and the deferred reads of the
  loss see each step's own value.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from conftest import cuda_devices  # noqa: E402


pytestmark = pytest.mark.skipif(cuda_devices() == 0, reason="no CUDA device visible")

from cosmotrain.comm.grid import ProcessGrid  # noqa: E402
from cosmotrain.config.layout import resolve_parallel  # noqa: E402
from cosmotrain.config.load import load_config  # noqa: E402
from cosmotrain.engine.step import hybrid_step_from_config  # noqa: E402
from cosmotrain.nn.module import Context  # noqa: E402
from cosmotrain.tensor.dist_tensor import DistTensor  # noqa: E402

STEPS = 6
NEVER = 10**6


def train(precision: str, warmup: int) -> tuple[list[float], dict, bool]:
    """``STEPS`` steps of the paper network at W = 32 with the graph after ``warmup``
    eager steps (``NEVER``: the same job, every step eager)."""
    from mpi4py import MPI

    cfg = load_config(None, [
        "model.name=cosmoflow", "model.width=32", "model.dropout=0.2", "train.batch_size=2",
        "optimizer.name=sgd", "optimizer.momentum=0.9", "device.backend=gpu",
        "device.conv_algorithm=cudnn", f"device.precision={precision}",
        "device.cuda_graph=true", f"device.cuda_graph_warmup={warmup}"])
    grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
    step = hybrid_step_from_config(cfg, grid)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 4, 32, 32, 32)).astype(np.float32)
    y = rng.normal(size=(2, 4)).astype(np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    outs = [step(DistTensor.scatter(x, dist, coord), y, Context(step=it, seed=5),
                 lr=0.01 * (1 + 0.25 * it)) for it in range(STEPS)]
    losses = [out.loss for out in outs]  # read after all were launched: one late each
    params = {n: cupy.asnumpy(p.data) for n, p in step.model.named_parameters()}
    replaying = step.graph.replaying
    grid.free()
    return losses, params, replaying


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_captured_step_trains_as_the_eager_step_on_the_device(precision: str) -> None:
    eager_losses, eager_params, captured = train(precision, NEVER)
    assert not captured
    losses, params, captured = train(precision, 2)
    assert captured
    rtol = 1e-5 if precision == "fp32" else 1e-2
    np.testing.assert_allclose(losses, eager_losses, rtol=rtol)
    assert len(set(losses)) == STEPS  # each read saw its own step
    for name, value in eager_params.items():
        np.testing.assert_allclose(params[name], value, rtol=rtol, atol=rtol * 1e-2,
                                   err_msg=name)
