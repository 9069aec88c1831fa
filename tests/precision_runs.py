"""Training steps under another precision or device against float32 on the CPU.

The helper of ``test_bf16*.py`` and ``test_gpu_engine.py``: :func:`step_run` trains a
few SGD steps of a config on a communicator (any layout, any device) from a fixed batch
and returns, as full host arrays, what the first step computed (predictions, loss,
every parameter gradient) and where the steps led (the losses, the parameters).
:func:`precision_errors` compares two runs: relative error norms, the gradients taken
as one vector (a layer whose gradient is rounding noise cannot dominate the verdict).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from equivalence import full_gradients, gather_rows, relative_error

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.load import load_config
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.device.select import Device
from cosmotrain.device.xp import to_host
from cosmotrain.nn.module import Context
from cosmotrain.precision import widen
from cosmotrain.tensor.dist_tensor import DistTensor
from cosmotrain.engine.step import hybrid_step_from_config, job_runtime

STEPS = 3
BATCH = 4
SGD = ["optimizer.name=sgd", "optimizer.lr=0.002", "optimizer.momentum=0.9"]


def config(model: list[str], extra: list[str] = ()):
    return load_config(None, [*model, f"train.batch_size={BATCH}", *SGD, *extra])


def step_run(comm: Any, model: list[str], extra: list[str] = (),
             device: Device | None = None) -> dict[str, Any]:
    """``STEPS`` steps of ``model`` on ``comm`` (``extra``: layout, precision)."""
    cfg = config(model, extra)
    grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
    step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
    rng = np.random.default_rng(7)
    width = cfg.model.width
    x = rng.normal(size=(BATCH, cfg.model.channels, width, width, width)).astype(np.float32)
    targets = rng.normal(size=(BATCH, cfg.model.outputs)).astype(np.float32)
    dist, coord = step.model.input_distribution(x.shape)
    run: dict[str, Any] = {"losses": []}
    for it in range(STEPS):
        out = step.gradients(DistTensor.scatter(x, dist, coord), targets,
                             Context(step=it, seed=cfg.train.seed))
        if it == 0:
            pred = np.asarray(widen(to_host(out.pred)), np.float32)
            run["pred"] = gather_rows(comm, out.rows, pred, targets.shape)
            run["grads"] = full_gradients(step.model)
        run["losses"].append(out.loss)
        step.update()
    run["params"] = step.model.full_parameters()
    grid.free()
    return run


def _vector(arrays: dict[str, Any]) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(arrays[name], np.float64))
                           for name in sorted(arrays)])


def precision_errors(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    """Relative errors: first-step predictions, loss and gradient (one vector), the
    losses of every step and the parameters at the end (one vector)."""
    found = {"pred": relative_error(got["pred"], ref["pred"]),
             "grad": relative_error(_vector(got["grads"]), _vector(ref["grads"])),
             "params": relative_error(_vector(got["params"]), _vector(ref["params"]))}
    found.update({f"loss{i}": abs(a - b) / abs(b)
                  for i, (a, b) in enumerate(zip(got["losses"], ref["losses"]))})
    return found


def over(errors: dict[str, float], bounds: dict[str, float]) -> list[str]:
    """The errors above their bound (``bounds`` by key prefix, e.g. ``loss``)."""
    def bound(key: str) -> float:
        return next(b for prefix, b in bounds.items() if key.startswith(prefix))

    return [f"{key} {value:.1e} > {bound(key):.0e}" for key, value in errors.items()
            if not value <= bound(key)]
