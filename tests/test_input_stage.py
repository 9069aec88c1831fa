"""int16 batches onto the device (engine/input_stage.py), checked on the stand-in cupy.

What these tests pin (docs/GPU.md, "What the CPU verifies"):

* the device's transform (kernels/cuda/src/input.cu, run by its host build) gives the
  CPU's float32 bits exactly, and the CPU's values rounded once to bf16 in bf16;
* a reader told ``keep_stored`` hands out the stored int16 counts with what the device
  needs to transform them, and staged they are the batches it hands out otherwise;
* in a training step the batch crosses as int16 (half the bytes of float32) from pinned
  memory, with no host read added and the same predictions as the host transform's;
* the double buffer's order: with copies that lag (tests/standin_streams.py) every batch
  still reads its own bytes, a missing compute-stream wait is caught, and the host waits
  before rewriting a pinned buffer whose copy is not known to be done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from standin import installed

from cosmotrain.data.readers.transform import (DeviceTransform, apply_transform,
                                                mean_divisors)
from cosmotrain.engine.input_stage import InputStage
from cosmotrain.precision import storage_dtype

SHAPE = (3, 4, 5, 6, 7)


def counts(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Particle counts as stored: mostly small, some zero, a few large, one row all zero."""
    rng = np.random.default_rng(seed)
    values = rng.poisson(3.0, size=shape) * rng.integers(0, 3, size=shape)
    values.flat[: 17] = 32767
    values[-1] = 0  # the mean transform leaves an all-zero sample at zero
    return values.astype(np.int16)


def transform_of(name: str, x: np.ndarray) -> DeviceTransform:
    means = x.reshape(len(x), -1).mean(axis=1, dtype=np.float64)
    return DeviceTransform(name, mean_divisors(means) if name == "mean" else None)


def host_result(name: str, x: np.ndarray) -> np.ndarray:
    means = x.reshape(len(x), -1).mean(axis=1, dtype=np.float64)
    return apply_transform(x, name, means if name == "mean" else None)


def stage_of(cupy: Any) -> InputStage:
    return InputStage(cupy, cupy.cuda.streams.empty_pinned)


def plain(array: Any) -> np.ndarray:
    return np.array(array.view(np.ndarray))


def staged_right(stage: InputStage, x: np.ndarray, name: str) -> bool:
    """Whether the stage makes of ``x`` in float32 the host transform's bits."""
    return plain(stage(x, transform_of(name, x), np.float32)).tobytes() == \
        host_result(name, x).tobytes()


@pytest.mark.parametrize("name", ["log1p", "mean", "none"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_device_transform_matches_the_host(name: str, precision: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    x = counts(1)
    dtype = storage_dtype(precision)
    with installed(monkeypatch) as cupy:
        y = stage_of(cupy)(x, transform_of(name, x), dtype)
        assert isinstance(y, cupy.ndarray) and y.dtype == dtype and y.shape == SHAPE
        got = plain(y)
    want = host_result(name, x).astype(dtype)  # one rounding to bf16, to nearest even
    assert got.tobytes() == want.tobytes()


def test_batches_cross_as_int16_from_pinned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half of float32's bytes; both slots pinned, used in turn; no host read."""
    x = counts(2)
    with installed(monkeypatch) as cupy:
        stage = stage_of(cupy)
        for seed in range(4):
            stage(counts(seed), transform_of("log1p", x), np.float32)
            ledger = cupy.ledger.take()
            assert ledger.syncs == []
            inputs = [u for u in ledger.uploads if u[0] == SHAPE]
            assert inputs == [(SHAPE, np.dtype(np.int16).str)]
        assert len(stage.slots) == 2
        assert all(cupy.cuda.streams.is_pinned(slot.host) for slot in stage.slots)
    assert np.prod(SHAPE) * 2 == x.nbytes == np.zeros(SHAPE, np.float32).nbytes // 2


@pytest.mark.parametrize("compute_waits", [True, False])
def test_lagging_copies_each_batch_reads_its_own_bytes(compute_waits: bool,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Copies that run only when waited on: each batch still reads its own bytes, with no
    host wait; and the stand-in can fail this: without the compute stream's wait the
    kernel reads stale bytes (an earlier batch's, or none)."""
    batches = [counts(seed) for seed in range(5)]
    with installed(monkeypatch) as cupy:
        cupy.cuda.streams.lagging = True
        if not compute_waits:
            monkeypatch.setattr(cupy.cuda.streams.current, "wait_event", lambda event: None)
        stage = stage_of(cupy)
        right = [staged_right(stage, x, "mean") for x in batches]
        waits = list(cupy.ledger.syncs)  # without it, the host guard waits at each reuse
    if compute_waits:
        assert right == [True] * 5 and waits == []
    else:
        assert not any(right[1:]) and waits == ["event.synchronize"] * 3


def test_host_waits_before_rewriting_a_busy_pinned_buffer(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Events that say "busy": the third batch (slot 0 again) waits for the first copy."""
    batches = [counts(seed) for seed in range(4)]
    with installed(monkeypatch) as cupy:
        cupy.cuda.streams.slow_events = True
        stage = stage_of(cupy)
        syncs = []
        for x in batches:
            assert staged_right(stage, x, "log1p")
            syncs.append(cupy.ledger.take().syncs)
    assert syncs == [[], [], ["event.synchronize"], ["event.synchronize"]]


def test_copy_into_a_slot_waits_for_the_kernel_that_read_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Device-side order (the stand-in runs kernels at once, so it is read from the log):
    before a copy rewrites a slot's device buffer, the copy stream waited on an event of
    the compute stream recorded after the last kernel that read that buffer."""
    with installed(monkeypatch) as cupy:
        streams = cupy.cuda.streams
        stage = stage_of(cupy)
        for seed in range(5):
            stage(counts(seed), transform_of("log1p", counts(seed)), np.float32)
        log = list(streams.log)
    written: dict[int, int] = {}  # device address -> index in the log of its last copy
    for at, (kind, stream, what) in enumerate(log):
        if kind != "copy" or stream is not stage.copy_stream:
            continue
        if what in written:
            between = log[written[what] + 1:at]
            assert ("wait", stage.copy_stream, streams.current) in between, at
        written[what] = at
    assert len(written) == 4  # two slots: counts and divisors each


@pytest.mark.parametrize("reader", ["preload", "direct"])
@pytest.mark.parametrize("name", ["log1p", "mean"])
def test_readers_keep_int16_for_the_device(reader: str, name: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged, a kept batch is the batch the same reader hands out transformed."""
    from mpi4py import MPI

    from cosmotrain.config.load import load_config
    from cosmotrain.data.readers.job_readers import make_readers, open_dataset
    from cosmotrain.data.readers.placement import BlockPlacement
    from cosmotrain.data.synthetic.datagen import generate_dataset

    generate_dataset(tmp_path, 6, 8, 3, val_fraction=0.0)  # int16 counts
    cfg = load_config(None, ["model.width=8", "train.batch_size=3", f"data.path={tmp_path}",
                             f"data.reader={reader}", f"data.transform={name}"])
    comm = MPI.COMM_SELF
    placement = BlockPlacement((1, 1, 1, 1, 1), (0, 0, 0, 0, 0), 4, 8)
    host = make_readers(cfg, open_dataset(cfg, comm), comm, placement, ["train"])["train"]
    kept = make_readers(cfg, open_dataset(cfg, comm), comm, placement, ["train"])["train"]
    kept.keep_stored = True
    with host, kept, installed(monkeypatch) as cupy:
        stage = stage_of(cupy)
        for index in range(host.batches_per_epoch):
            want, got = host.batch(0, index), kept.batch(0, index)
            assert want.device_transform is None and want.x.data.dtype == np.float32
            assert got.x.data.dtype == np.int16 and got.device_transform.name == name
            staged = plain(stage(got.x.data, got.device_transform, np.float32))
            assert staged.tobytes() == want.x.data.tobytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_step_takes_int16_batches(precision: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The real device step, fed the stored counts: the input crosses as int16 (half the
    bytes of the float32 it crossed as), with the same host reads (none added) and the
    same predictions as the host-transformed batch gives."""
    from mpi4py import MPI

    from cosmotrain.comm.grid import ProcessGrid
    from cosmotrain.config.layout import resolve_parallel
    from cosmotrain.config.load import load_config
    from cosmotrain.device.select import Device
    from cosmotrain.engine.step import hybrid_step_from_config, job_runtime
    from cosmotrain.nn.module import Context
    from cosmotrain.tensor.dist_tensor import DistTensor

    cfg = load_config(None, ["model.name=cosmoflow", "model.width=16", "train.batch_size=2",
                             "optimizer.name=sgd", "optimizer.lr=0.002",
                             "device.conv_algorithm=gemm", f"device.precision={precision}"])
    shape = (2, cfg.model.channels, 16, 16, 16)
    targets = np.random.default_rng(3).normal(size=(2, cfg.model.outputs)).astype(np.float32)

    def run(stored: bool) -> tuple[list, list, list]:
        with installed(monkeypatch) as cupy:
            grid = ProcessGrid(MPI.COMM_SELF, resolve_parallel(cfg, 1))
            device = Device("gpu", 0, precision, "staging", "gemm")
            step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device))
            syncs, inputs, preds = [], [], []
            for it in range(3):
                x = counts(it, shape)
                data = x if stored else host_result("log1p", x)
                dist, coord = step.model.input_distribution(shape)
                cupy.ledger.take()
                out = step(DistTensor(data, dist, coord), targets, Context(step=it, seed=1),
                           transform=transform_of("log1p", x) if stored else None)
                ledger = cupy.ledger.take()
                syncs.append(ledger.syncs)
                inputs.append([u for u in ledger.uploads if u[0] == shape])
                with cupy.ledger.paused():
                    preds.append(plain(out.pred))
            grid.free()
        return syncs, inputs, preds

    host_syncs, host_inputs, host_preds = run(stored=False)
    syncs, inputs, preds = run(stored=True)
    assert syncs == host_syncs and syncs[1:] == [[], []]
    assert host_inputs == [[(shape, np.dtype(np.float32).str)]] * 3
    assert inputs == [[(shape, np.dtype(np.int16).str)]] * 3  # 2 bytes a value, not 4
    for mine, theirs in zip(preds, host_preds):
        assert mine.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("name", ["log1p", "mean", "none"])
def test_a_kept_batch_on_the_cpu_is_transformed_on_the_host(name: str) -> None:
    """``place_input`` without a device applies the transform itself, with the reader's
    bits (so a kept batch is never computed on as raw counts)."""
    from cosmotrain.data.readers.transform import host_transform

    x = counts(4)
    assert host_transform(x, transform_of(name, x)).tobytes() == \
        host_result(name, x).tobytes()


def test_training_on_a_device_stages_the_train_batches(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``build_job`` on a device keeps the train reader's int16 counts (validation's are
    transformed on the host as before) and the trainer hands them to the stage: the run's
    loss and MAE are the CPU run's (the stand-in's convolutions are gemm: rtol 1e-5)."""
    from mpi4py import MPI

    from cosmotrain.config.load import load_config
    from cosmotrain.data.synthetic.datagen import generate_dataset
    from cosmotrain.device.select import Device
    from cosmotrain.train import job_setup
    from cosmotrain.train.trainer import Trainer

    generate_dataset(tmp_path / "data", 8, 16, 3, val_fraction=0.25)  # int16 counts

    def run(device: Device | None) -> tuple[Any, dict]:
        cfg = load_config(str(Path(__file__).parents[1] / "configs" / "tiny.yaml"),
                          [f"data.path={tmp_path / 'data'}", "data.source=files",
                           f"output.dir={tmp_path / str(device is None)}"])
        if device is not None:
            monkeypatch.setattr(job_setup, "select_device", lambda cfg, comm: device)
        job = job_setup.build_job(cfg, MPI.COMM_SELF)
        return job, Trainer(job).run()

    _, on_cpu = run(None)
    with installed(monkeypatch) as cupy:
        job, on_device = run(Device("gpu", 0, "fp32", "staging", "gemm"))
        kept = [u for u in cupy.ledger.uploads if u[1] == np.dtype(np.int16).str]
    assert job.readers["train"].keep_stored and not job.readers["validation"].keep_stored
    assert job.step.stage is not None and len(kept) == on_device["step"]  # one a step
    for key in ("final_loss", "best_mae"):
        assert on_device[key] == pytest.approx(on_cpu[key], rel=1e-5)
