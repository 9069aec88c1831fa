"""``output.tensorboard: true``: the event files hold metrics.jsonl's numbers, tag by tag,
at its steps, and a run resumed from an earlier checkpoint continues the same curves.

The events are read back without TensorBoard: an event file is a TFRecord stream (read with
the independent ``tfrecord`` package) of ``Event`` protobufs (decoded with tensorboardX's
own ``event_pb2``), and the purge a ``SessionLog.START`` event asks for is applied the way
TensorBoard does (files in name order; a START at step s drops the events of step >= s read
so far).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mpi4py import MPI

pytest.importorskip("tensorboardX")
tfrecord_reader = pytest.importorskip("tfrecord.reader")

from tensorboardX.proto.event_pb2 import Event, SessionLog  # noqa: E402

from cosmotrain.config.load import load_config  # noqa: E402
from cosmotrain.errors import UserError  # noqa: E402
from cosmotrain.train import run as runner
from cosmotrain.train.outputs import tensorboard as tensorboard_log  # noqa: E402
from cosmotrain.train.checkpoints.checkpoint import checkpoint_dir, list_checkpoints  # noqa: E402
from cosmotrain.train.outputs.metrics import TIME_KEYS, metrics_path, read_metrics  # noqa: E402
from cosmotrain.train.outputs.observers import Observer  # noqa: E402
from cosmotrain.train.run import make_observers  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def config(out: Path, *extra: str):
    return load_config(TINY, ["data.source=synthetic", "data.synthetic.samples=10",
                              "data.synthetic.val_fraction=0.2", "model.width=8",
                              "train.batch_size=4", "train.log_every=1",
                              "output.tensorboard=true", f"output.dir={out}", *extra])


def read_events(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Scalars by tag: (step, value, wall time), as TensorBoard would show them."""
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    curves: dict[str, list[tuple[int, float, float]]] = {}
    for file in files:
        for raw in tfrecord_reader.tfrecord_iterator(str(file)):
            event = Event.FromString(bytes(raw))
            if event.HasField("session_log") and \
                    event.session_log.status == SessionLog.START:
                curves = {tag: [p for p in points if p[0] < event.step]
                          for tag, points in curves.items()}
            for value in event.summary.value:
                curves.setdefault(value.tag, []).append(
                    (event.step, value.simple_value, event.wall_time))
    return curves


def expected(records: list[dict]) -> dict[str, list[tuple[int, float | None, float]]]:
    """metrics.jsonl's numbers under the documented tags."""
    curves: dict[str, list[tuple[int, float | None, float]]] = {}

    def add(tag: str, record: dict, value: float | None) -> None:
        curves.setdefault(tag, []).append((record["step"], value, record["time"]))

    for r in records:
        if r["kind"] == "train":
            for key in ("loss", "lr", "samples_per_s", "step_time_s"):
                add(f"train/{key}", r, r[key])
            for key in TIME_KEYS:
                add(f"time/{key}", r, r["time_s"][key])
            add("memory/hwm_mib_max", r, max(r["memory_hwm_mib"]))
        elif r["kind"] == "validation":
            for metric in ("mse", "mae"):
                add(f"validation/{metric}", r, r[metric])
                for i, value in enumerate(r[f"{metric}_per_param"]):
                    add(f"validation/{metric}_target{i}", r, value)
    return curves


def assert_same(events: dict, wanted: dict) -> None:
    assert sorted(events) == sorted(wanted)
    for tag, points in wanted.items():
        got = events[tag]
        assert [p[0] for p in got] == [p[0] for p in points], tag
        for (_, value, wall), (_, want, want_wall) in zip(got, points):
            if want is None:
                assert math.isnan(value), tag
            else:  # simple_value is a float32
                assert value == pytest.approx(want, rel=1e-6, abs=1e-12), tag
            assert wall == pytest.approx(want_wall, abs=1e-3), tag


def test_event_files_hold_the_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    runner.run_training(config(out, "train.epochs=2", "train.max_steps=null"),
                        MPI.COMM_WORLD)
    records = read_metrics(metrics_path(out))
    wanted = expected(records)
    assert len(wanted["train/loss"]) == 4 and len(wanted["validation/mae"]) == 2
    assert "validation/mae_target3" in wanted and "time/halo" in wanted
    assert_same(read_events(out / "tensorboard"), wanted)


def test_a_resumed_run_continues_the_same_curves(tmp_path: Path) -> None:
    """Run 1 logs steps 1-4 but its last checkpoints are lost; run 2 resumes from step 2,
    so run 1's steps 3-4 (and the validation at 4) must give way to run 2's."""
    out = tmp_path / "run"
    runner.run_training(config(out, "train.epochs=3", "train.max_steps=4",
                               "train.checkpoint_every_steps=1"), MPI.COMM_WORLD)
    first = read_metrics(metrics_path(out))
    for step, path in list_checkpoints(checkpoint_dir(out)):
        if step > 2:
            path.unlink()
    runner.run_training(config(out, "train.epochs=3", "train.max_steps=null",
                               "train.checkpoint_every_steps=1"), MPI.COMM_WORLD,
                        resume=True)
    records = read_metrics(metrics_path(out))
    events = read_events(out / "tensorboard")
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2
    wanted = expected(records)
    assert [p[0] for p in wanted["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [p[0] for p in wanted["validation/mae"]] == [2, 4, 6]
    assert_same(events, wanted)
    old_step3 = next(r for r in first if r["kind"] == "train" and r["step"] == 3)
    new_step3 = next(r for r in records if r["kind"] == "train" and r["step"] == 3)
    assert old_step3["time"] != new_step3["time"]  # the purge is what made them agree


def test_off_by_default_and_only_rank_0_writes(tmp_path: Path) -> None:
    plain = load_config(TINY, [f"output.dir={tmp_path}"])
    assert plain.output.tensorboard is False
    assert make_observers(plain, tmp_path, 0).members == []
    cfg = config(tmp_path)
    [member] = make_observers(cfg, tmp_path, 0).members
    assert isinstance(member, tensorboard_log.TensorBoardLog)
    assert type(make_observers(cfg, tmp_path, 1)) is Observer


def test_without_tensorboardx_every_rank_stops_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli) -> None:
    real = tensorboard_log.importlib.util.find_spec
    monkeypatch.setattr(tensorboard_log.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    for rank in (0, 1):
        with pytest.raises(UserError, match=r'pip install -e "\.\[tensorboard\]"'):
            make_observers(config(tmp_path), tmp_path, rank)
    code, _, err = cli("train", "--config", str(TINY), "--set", "data.source=synthetic",
                       "--set", "data.synthetic.samples=10", "--set", "model.width=8",
                       "--set", "output.tensorboard=true",
                       "--set", f"output.dir={tmp_path / 'run'}")
    assert code == 2
    [line] = err.strip().splitlines()
    assert "tensorboardX" in line and "output.tensorboard" in line
    assert not (tmp_path / "run" / "tensorboard").exists()
