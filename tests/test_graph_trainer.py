"""The real trainer loop over a captured step (``device.cuda_graph``) on the stand-in cupy:
int16 batches staged through pinned memory, the graph replayed, each step read one late.

* the run's records, checkpoints and final parameters are those of the same job
  trained eagerly, bit for bit (tests/test_cuda_graph.py checks single steps);
* the next batch's copy is queued while the step before it may still run: the host
  issues batch k + 1's copy to the device before it waits for step k (its one read,
  one step late), and nothing else waits between them;
* a NaN in a replayed step stops the run before a checkpoint holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from standin import shared
from test_cuda_graph import allow_stand_in_convolutions
from test_deferred_reads import READ, Batches, Run, steps_recorded, train

from cosmotrain.data.readers.base import Batch
from cosmotrain.data.readers.transform import DeviceTransform
from cosmotrain.engine.input_stage import InputStage
from cosmotrain.train.stops import NonFiniteError

GRAPH = ["device.cuda_graph=true", "device.cuda_graph_warmup=2"]
EAGER = ["device.cuda_graph=true", "device.cuda_graph_warmup=1000000"]


class Counts(Batches):
    """The batches as the readers keep them for a device: int16 counts, log1p left to
    the device (``Batch.device_transform``)."""

    def batch(self, epoch: int, index: int) -> Batch:
        floats = super().batch(epoch, index)
        counts = np.abs(floats.x.data * 40).astype(np.int16)
        x = type(floats.x)(counts, floats.x.dist, floats.x.coord)
        return Batch(x, floats.targets, floats.indices, epoch, index,
                     DeviceTransform("log1p"))


@pytest.fixture
def graph_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """Int16 batches, and the stand-in's gemm products standing in for cuDNN's."""
    import test_deferred_reads

    monkeypatch.setattr(test_deferred_reads, "Batches", Counts)
    allow_stand_in_convolutions(monkeypatch, shared())


def trained(monkeypatch: pytest.MonkeyPatch, path: Path, extra: list[str],
            **kwargs: Any) -> tuple[Run, dict]:
    """Two epochs."""
    run = Run()
    summary = train(monkeypatch, path, run, ["train.epochs=2", *extra], **kwargs)
    return run, summary


def test_the_trainer_over_a_graph_records_what_the_eager_run_records(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, graph_ready: None) -> None:
    eager, _ = trained(monkeypatch, tmp_path / "eager", EAGER)
    graphed, _ = trained(monkeypatch, tmp_path / "graph", GRAPH)
    assert shared().graphs.captures == 1
    assert graphed.events == eager.events
    assert len(eager.params) == len(graphed.params) == 2 * 5 + 1
    for name, value in eager.params[-1].items():
        np.testing.assert_array_equal(graphed.params[-1][name], value, err_msg=name)
    assert steps_recorded(graphed) == list(range(1, 11))


def test_the_next_batch_is_copied_while_the_step_before_may_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, graph_ready: None) -> None:
    """In the timeline: batch k + 1's copy is queued (on the copy stream) after step k
    was launched and before the host reads step k's values, the wait for step k."""
    timeline: list[str] = []
    real = InputStage._upload

    def upload(self: Any, slot: Any, counts: Any, transform: Any) -> None:
        real(self, slot, counts, transform)
        marks = [line for line in timeline if line.startswith("launch ")]
        timeline.append(f"copy for {len(marks)}")
    monkeypatch.setattr(InputStage, "_upload", upload)
    run = Run(timeline=timeline)
    train(monkeypatch, tmp_path, run, GRAPH)
    for k in range(3, 5):  # launches 3 (the capture) and 4 (a replay)
        copy = timeline.index(f"copy for {k + 1}")
        assert timeline.index(f"launched {k}") < copy < timeline.index(f"read {k}"), \
            timeline
        between = timeline[timeline.index(f"launched {k}") + 1:copy]
        assert between == [f"read {k - 1}", READ, f"launch {k + 1}"], between


def test_a_nan_in_a_replayed_step_stops_the_run_before_a_checkpoint(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, graph_ready: None) -> None:
    run = Run()
    with pytest.raises(NonFiniteError):
        train(monkeypatch, tmp_path, run, GRAPH, bad=3)
    assert shared().graphs.captures == 1
    before_bad = run.params[3]  # before step index 3 (the fourth launch)
    for name, value in before_bad.items():
        np.testing.assert_array_equal(run.params[-1][name], value, err_msg=name)
