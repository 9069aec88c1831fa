"""bf16 storage on one process (the CPU emulation of ``device.precision: bf16``).

A bf16 step stores activations and their gradients as bfloat16 and rounds the weights
to bf16 where convolutions and linear layers read them; everything is accumulated in
float32 and applied to float32 master weights.  Against the float32 step of the same
network, from the same batch (``tests/precision_runs.py``):

* cosmoflow at 32^3 (the real network; dropout on): first-step predictions, the 3
  losses, the gradient taken as one vector and the parameters after 3 SGD steps within
  1e-2 (measured 1.9e-3, 3e-4..9e-4, 2.9e-3, 1.7e-5);
* no layer's gradient off by more than 0.25: cosmoflow's convolution gradients are
  small (vanishing without batch norm) and LeakyReLU kinks and max-pool winners that
  bf16 rounding flips move them by 6e-2..9e-2 (float32 against float64: 1e-6); a missed
  reduction or a wrong kernel shows as O(1);
* tiny with batch norm (every layer kind): first-step predictions and loss within 1e-2.

The masters, their gradients and the optimizer state stay float32; a bf16 run writes
float32 checkpoints and resumes.
"""

from __future__ import annotations

import h5py
import numpy as np
from conftest import REPO
from equivalence import relative_error
from precision_runs import precision_errors, step_run

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.load import load_config
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.nn.module import Context
from cosmotrain.precision import is_bf16
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.step import hybrid_step_from_config

COSMOFLOW = ["model.name=cosmoflow", "model.width=32", "model.dropout=0.2"]
TINY_BN = ["model.name=tiny", "model.width=13", "model.batchnorm=true", "model.dropout=0.3"]
BF16 = ["device.precision=bf16"]


def world_self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_bf16_cosmoflow_steps_match_float32() -> None:
    ref = step_run(world_self(), COSMOFLOW)
    got = step_run(world_self(), COSMOFLOW, BF16)
    errors = precision_errors(got, ref)
    assert all(value <= 1e-2 for value in errors.values()), errors
    layers = {name: relative_error(got["grads"][name], grad)
              for name, grad in ref["grads"].items()}
    assert all(value <= 0.25 for value in layers.values()), layers


def test_bf16_tiny_batchnorm_first_step_matches_float32() -> None:
    ref = step_run(world_self(), TINY_BN)
    got = step_run(world_self(), TINY_BN, BF16)
    errors = precision_errors(got, ref)
    assert errors["pred"] <= 1e-2 and errors["loss0"] <= 1e-2, errors


def test_bf16_storage_and_float32_masters() -> None:
    """Activations are bf16 between layers; parameters, gradients, optimizer state and
    batch-norm statistics stay float32."""
    cfg = load_config(None, [*TINY_BN, "train.batch_size=2", *BF16])
    comm = world_self()
    grid = ProcessGrid(comm, resolve_parallel(cfg, 1))
    step = hybrid_step_from_config(cfg, grid)
    seen = []
    for layer in step.model.head.items:
        original = layer.forward
        layer.forward = (lambda x, ctx, f=original: seen.append(f(x, ctx)) or seen[-1])
    x = np.random.default_rng(0).normal(size=(2, 4, 13, 13, 13)).astype(np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    step(DistTensor.scatter(x, dist, coord), np.zeros((2, 4), np.float32), Context())
    assert seen and all(is_bf16(y) for y in seen)
    params = list(step.model.named_parameters())
    assert all(p.data.dtype == np.float32 for _, p in params)
    assert all(np.asarray(v).dtype == np.float32 for slots in step.optimizer.state.values()
               for v in slots.values() if np.ndim(v))
    assert all(np.asarray(layer.buffers["running_mean"]).dtype == np.float32
               for _, layer, key in step.model.named_buffers() if key == "running_mean")
    step.gradients(DistTensor.scatter(x, dist, coord), np.zeros((2, 4), np.float32),
                   Context())
    assert all(p.grad.dtype == np.float32 for _, p in params)
    grid.free()


def test_bf16_training_writes_float32_checkpoints_and_resumes(cli, tmp_path) -> None:
    common = ["--config", str(REPO / "configs" / "tiny.yaml"), "--set",
              "device.precision=bf16", "--set", f"output.dir={tmp_path}", "--set",
              "train.checkpoint_every_steps=2"]
    code, _, err = cli("train", *common, "--set", "train.max_steps=2")
    assert code == 0, err
    with h5py.File(sorted((tmp_path / "checkpoints").glob("*.h5"))[-1]) as f:
        assert {f["params"][name].dtype for name in f["params"]} == {np.dtype(np.float32)}
        assert "precision: bf16" in f["config"][()].decode()
    code, _, err = cli("train", *common, "--set", "train.max_steps=3", "--resume")
    assert code == 0, err
