"""The sharded optimizer's update on the stand-in GPU (tests/standin.py): one
multi-tensor launch that skips on the step's device flag
(``engine/optim_shards_device.py``), not the update run and then undone by copies
(``device_verdict.guarded_update``).  The engine's real N2 step with
``parallel.shard_optimizer`` runs through tests/test_gpu_step_counts.py's ``training``.

Pinned here, for SGD with momentum and for Adam: ``sgd_momentum_multi`` (``adam_multi``)
launched once per steady step, no ``copyto`` of the guard, and its address table
uploaded at the first step only; the parameters after three
steps equal, bit for bit, the unsharded device step's (two ranks add their halves in
either order alike) and the CPU's sharded run's (Adam's to float32 rounding: its step
divides by the gradient's size, so the last bits in which the stand-in's gemm
convolutions and the CPU's differ show, as they do unsharded; under SGD they vanish
below the parameters' rounding); a non-finite step leaves the parameters and every slot
as they were.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_gpu_step_counts as counts
from conftest import abort_on_error

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.config.layout import resolve_parallel
from cosmotrain.engine.step import HybridStep, hybrid_step_from_config
from cosmotrain.nn.module import Context
from cosmotrain.tensor.dist_tensor import DistTensor

N2 = ["parallel.sample=2"]
SGD: list[str] = []  # the table's SGD with momentum
ADAM = ["optimizer.name=adam", "optimizer.lr=0.001"]


def state(step: Any) -> dict[str, np.ndarray]:
    """Parameters and array slots as host copies (the stand-in's arrays are numpy's)."""
    arrays = {name: p.data for name, p in step.model.named_parameters()}
    arrays.update({f"{n}.{k}": v for n, slots in step.optimizer.state.items()
                   for k, v in slots.items() if np.ndim(v)})
    return {name: np.array(np.asarray(a).view(np.ndarray)) for name, a in arrays.items()}


def parameters(step: Any) -> dict[str, np.ndarray]:
    return {name: np.array(np.asarray(p.data).view(np.ndarray))
            for name, p in step.model.named_parameters()}


def cpu_parameters(comm: Any, extra: list[str]) -> dict[str, np.ndarray]:
    cfg = counts.config("cosmoflow", extra)
    grid = ProcessGrid(comm, resolve_parallel(cfg, comm.Get_size()))
    step = hybrid_step_from_config(cfg, grid)
    x, targets = counts.batch("cosmoflow")
    dist, coord = step.model.input_distribution(x.shape)
    for it in range(counts.STEPS):
        step(DistTensor.scatter(x, dist, coord), targets, Context(step=it, seed=cfg.train.seed))
    grid.free()
    return parameters(step)


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name, strict=True)


@pytest.mark.parallel(nprocs=[2])
@abort_on_error
def test_sharded_update_is_one_launch_that_skips_on_the_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    good = counts.batch("cosmoflow")
    for optimizer, kernel in ((SGD, "sgd_momentum_multi"), (ADAM, "adam_multi")):
        sharded, unsharded = [*counts.N2_SHARDED, *optimizer], [*N2, *optimizer]
        step, ledgers, _, _ = counts.training(comm, monkeypatch, "cosmoflow", sharded, [good])
        counts.check_steady_state(ledgers)
        launched = [launch.kernel for launch in ledgers[-1].launches]
        assert launched.count(kernel) == 1 and "copyto" not in launched, kernel
        # the address table stays put (the same arrays every step): uploaded once
        assert not [upload for upload in ledgers[-1].uploads if upload[1] == "<u8"]
        params = parameters(step)
        _same(params, parameters(counts.training(comm, monkeypatch, "cosmoflow", unsharded,
                                                 [good])[0]))
        cpu = cpu_parameters(comm, sharded)
        if optimizer is SGD:
            _same(params, cpu)
        else:  # Adam divides by the gradient's size: the convolutions' last bits show
            for name, array in cpu.items():
                np.testing.assert_allclose(params[name], array, rtol=1e-5, atol=1e-8,
                                           err_msg=name)

    bad = (good[0], good[1].copy())
    bad[1][0, 0] = np.nan
    kept: list[dict[str, np.ndarray]] = []
    real_call = HybridStep.__call__

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real_call(self, *args, **kwargs)
        kept.append(state(self))
        return out
    monkeypatch.setattr(HybridStep, "__call__", recording)
    _, ledgers, outs, _ = counts.training(comm, monkeypatch, "cosmoflow", counts.N2_SHARDED,
                                          [good, bad, good])
    assert outs[0].finite and not outs[1].finite and not outs[2].finite
    assert [launch.kernel for launch in ledgers[1].launches].count("sgd_momentum_multi") == 1
    for later in kept[1:]:
        _same(later, kept[0])
