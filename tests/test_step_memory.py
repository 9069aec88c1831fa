"""Planned host memory for repeated steps (``device.plan_step_memory``): the offline
placement, and the compiled allocator numpy uses in a fresh process (it is numpy's
allocator for the rest of a process once installed, so those tests run in subprocesses).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosmotrain.device import step_memory
from cosmotrain.device.step_memory import UNPLANNED, place

MIB = 1 << 20


def _live_peak(sizes, born, died) -> int:
    events = sorted([(t, s) for s, t in zip(sizes, born)] +
                    [(t, -s) for s, t in zip(sizes, died) if t >= 0])
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def _assert_no_overlap(plan, born, died) -> None:
    for i in range(len(born)):
        for j in range(i):
            if UNPLANNED in (plan.offsets[i], plan.offsets[j]):
                continue
            meet_in_time = born[i] < died[j] and born[j] < died[i]
            meet_in_space = (plan.offsets[i] < plan.offsets[j] + plan.sizes[j] and
                             plan.offsets[j] < plan.offsets[i] + plan.sizes[i])
            assert not (meet_in_time and meet_in_space), (i, j)


def test_placement_packs_a_step_that_fragments_first_fit_into_its_live_peak() -> None:
    """The pattern of a training step: activations kept for backward, a temporary between
    them, gradients of the same sizes in reverse.  Address-ordered first fit puts the
    second activation in the temporary's place and the large gradient above everything
    (64 + 32 + 32 + 64 = 192 MiB); the plan's span is the bytes live at once, 160."""
    # ticks: a0 t1 f_t a2 | g3 (=a2's size) f_a2 g4 f_g3 f_a0 f_g4
    sizes = [64 * MIB, 8 * MIB, 32 * MIB, 32 * MIB, 64 * MIB]
    born = [0, 1, 3, 4, 6]
    died = [8, 2, 5, 7, 9]
    plan = place(sizes, born, died)
    _assert_no_overlap(plan, born, died)
    assert plan.span == _live_peak(sizes, born, died) == 160 * MIB


def test_placement_of_random_lifetimes_never_overlaps_and_leaves_escapes_to_malloc() -> None:
    rng = np.random.default_rng(0)
    count = 120
    sizes = (rng.integers(1, 64, count) * MIB).tolist()
    born = sorted(rng.integers(0, 1000, count).tolist())
    died = [b + int(rng.integers(1, 300)) for b in born]
    died[5] = died[17] = -1  # alive at the end of the phase
    plan = place(sizes, born, died)
    _assert_no_overlap(plan, born, died)
    assert plan.offsets[5] == plan.offsets[17] == UNPLANNED
    assert (plan.offsets[[k for k in range(count) if k not in (5, 17)]] != UNPLANNED).all()
    kept = [k for k in range(count) if died[k] >= 0]
    peak = _live_peak(*([seq[k] for k in kept] for seq in (sizes, born, died)))
    assert peak <= plan.span <= 1.25 * peak


PHASES = r"""
import json, sys, threading
import numpy as np
from cosmotrain.device import heap, step_memory

heap.reuse_freed_memory()
assert step_memory.install()
memory = step_memory.current()
MIB = 1 << 20

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def step(scale, kept):
    # forward: activations kept; a temporary between; backward: gradients in reverse
    a0 = np.full(64 * MIB // 4 * scale, 1, np.float32)
    t = np.full(8 * MIB // 4, 7, np.float32)
    a1 = np.full(32 * MIB // 4, 2, np.float32)
    del t
    g1 = np.zeros(32 * MIB // 4, np.float32)
    assert not g1.any(), "np.zeros of reused pages must be zero"
    g1 += 3
    del a1
    g0 = np.zeros(64 * MIB // 4 * scale, np.float32)
    assert not g0.any()
    g0 += 4
    other = []
    worker = threading.Thread(target=lambda: other.append(np.ones(4 * MIB)))
    worker.start(); worker.join()
    grown = np.ones(2 * MIB // 8)
    grown.resize(3 * MIB // 8, refcheck=False)  # realloc of a numbered block
    assert (grown[:2 * MIB // 8] == 1).all() and (grown[2 * MIB // 8:] == 0).all()
    del grown
    for array, value in ((a0, 1), (g1, 3), (g0, 4), (other[0], 1)):
        assert (array == value).all(), value
    del g1, a0, g0
    kept.append(np.full(2 * MIB // 4, 5, np.float32))  # outlives its phase

kept, out = [], []
for index, scale in enumerate([1, 1, 1, 1, 2, 2, 2]):
    with step_memory.phase("train"):
        step(scale, kept)
    stats = memory.statistics()
    out.append({k: stats[k] for k in ("planned", "fallbacks", "replans", "arena_touched")})
    out[-1]["rss"] = rss_mib()
assert all((k == 5).all() for k in kept)
print(json.dumps(out))
"""


@pytest.mark.skipif(step_memory._native_module() is None or not Path("/proc/self/status").exists(),
                    reason="needs the compiled allocator and Linux")
def test_steps_run_on_their_plan_and_a_changed_step_is_planned_again() -> None:
    """Each step numbers eleven arrays (a0 t a1 g1 g0, the resized array before and
    after, and the four boolean arrays of its final checks) and leaves the one that
    outlives it to malloc; another thread's array is never numbered.  The first step runs
    unplanned, every later one on the plan of the step before; when the step changes
    (scale 2) one step runs unplanned again and the next is planned."""
    done = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.splitlines()[-1])
    planned = [s["planned"] for s in stats]
    gains = [b - a for a, b in zip([0] + planned, planned)]
    assert gains == [0, 11, 11, 11, 0, 11, 11], stats
    assert [s["replans"] for s in stats] == [1, 1, 1, 1, 2, 2, 2], stats
    # the arena holds exactly what is live at once: a0 + g1 + g0 + a 16 MiB check,
    # (64 + 32 + 64 + 16) MiB, then (128 + 32 + 128 + 32) MiB at scale 2
    assert [s["arena_touched"] // MIB for s in stats[1:4]] == [176] * 3, stats
    assert [s["arena_touched"] // MIB for s in stats[5:]] == [320] * 2, stats
    # the changed step abandons its plan at its first array: the arena's pages go back
    # and it runs on memory maps of its own, so it holds no more than its live arrays
    assert stats[4]["rss"] < stats[3]["rss"] - 100, stats
    # planned steps add no resident memory beyond the 2 MiB each one keeps
    for before, after in zip(stats[1:3] + stats[5:6], stats[2:4] + stats[6:7]):
        assert after["rss"] - before["rss"] < 4, stats


def test_without_an_installed_allocator_a_phase_is_nothing(monkeypatch) -> None:
    """Library calls and tests that build steps without a job run without a plan."""
    monkeypatch.setattr(step_memory, "_memory", None)
    with step_memory.phase("train"):
        array = np.ones(4 * MIB)
    assert array.sum() == 4 * MIB and step_memory.current() is None


TRAIN_AND_REPORT = r"""
import json, sys
from cosmotrain.cli import main
from cosmotrain.device import step_memory
try:
    main()  # reads sys.argv[1:]
except SystemExit as stop:
    assert not stop.code, stop.code
print(json.dumps(step_memory.current().statistics()))
"""


@pytest.mark.skipif(step_memory._native_module() is None, reason="needs the compiled allocator")
def test_training_and_validation_steps_run_on_their_plans(tmp_path: Path) -> None:
    """``cosmotrain train`` reads each batch, steps and frees it in one planned phase,
    and validates batch by batch in another: after the first steps every large array of
    both comes from its plan (12 training steps, 3 validation passes of 2 batches)."""
    sets = ["model.name=tiny", "model.width=32", "data.source=synthetic",
            "data.synthetic.samples=40", "data.synthetic.val_fraction=0.2",
            "train.batch_size=8", "train.epochs=3", "optimizer.name=adam",
            f"output.dir={tmp_path}"]
    command = [sys.executable, "-c", TRAIN_AND_REPORT, "train",
               *[arg for item in sets for arg in ("--set", item)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout.splitlines()[-1])
    assert set(stats["plans"]) == {"train", "eval"}, stats
    assert stats["plans"]["train"] > 0 and stats["plans"]["eval"] > 0, stats
    # two unplanned training steps (the first allocates the optimizer state) and one
    # validation batch; every later array planned
    assert stats["planned"] > 4 * stats["fallbacks"], stats


class FakeNative:
    """The compiled part's interface, recording calls: each phase's log is scripted."""

    def __init__(self, logs: list) -> None:
        self.logs, self.calls = list(logs), []

    def begin(self, sizes: bytes, offsets: bytes) -> None:
        self.calls.append(("begin", len(sizes) // 8))

    def end(self) -> tuple:
        sizes, misses = self.logs.pop(0)
        born = list(range(len(sizes)))
        died = [t + 1 for t in born]
        as_bytes = [np.asarray(v, np.int64).tobytes() for v in (sizes, born, died)]
        return (*as_bytes, misses)

    def trim(self) -> None:
        self.calls.append(("trim",))


def test_a_phase_is_replanned_only_after_a_miss_and_trims_the_heap_once_per_kind() -> None:
    native = FakeNative([([MIB, 2 * MIB], 2), ([MIB, 2 * MIB], 0), ([MIB], 1),
                         ([MIB], 0)])
    memory = step_memory.StepMemory(native)
    for kind in ("train", "train", "train", "eval"):
        with memory.phase(kind):
            with memory.phase("eval"):  # nested: the outer phase numbers everything
                pass  # the phase's allocations are the fake's scripted log
    assert native.calls == [("trim",), ("begin", 0), ("begin", 2), ("begin", 2),
                            ("trim",), ("begin", 0)]
    assert memory.replans == 3  # the first train, the changed third one, the first eval
    assert memory.active is None


def test_a_phase_of_too_many_arrays_is_left_to_malloc() -> None:
    native = FakeNative([([MIB] * (step_memory.MAX_PLANNED + 1), 1)])
    memory = step_memory.StepMemory(native)
    for _ in range(3):
        with memory.phase("train"):
            pass  # the phase's allocations are the fake's scripted log
    assert native.calls == [("trim",), ("begin", 0)] and memory.replans == 0
