"""Learning-rate schedules: formulas at the boundaries, monotonicity, config validation and
equality with torch.optim.lr_scheduler."""

from __future__ import annotations

import math
import warnings

import pytest

from cosmotrain.config.load import load_config
from cosmotrain.errors import ConfigError
from cosmotrain.engine.schedule import LRSchedule, build_schedule, parse_numbers

S = "optimizer.schedule."


def schedule(*overrides: str) -> LRSchedule:
    return build_schedule(load_config(None, overrides))


def mlperf() -> LRSchedule:
    """The MLPerf HPC CosmoFlow reference: 4-epoch warm-up, x0.25 at 32, x0.125 at 64."""
    return schedule("optimizer.lr=0.004", "train.epochs=128", f"{S}name=step",
                    f"{S}warmup_epochs=4", f"{S}warmup_start_lr=0.001",
                    f"{S}decay_epochs=32,64", f"{S}decay_factors=0.25,0.125")


def test_default_is_constant_optimizer_lr() -> None:
    s = schedule("optimizer.lr=0.02")
    assert s.name == "constant"
    assert [s(step, 7) for step in (0, 1, 6, 7, 10_000)] == [0.02] * 5


def test_constant_with_warmup_ramps_then_holds() -> None:
    s = schedule("optimizer.lr=0.1", f"{S}warmup_epochs=2", f"{S}warmup_start_lr=0.0")
    assert s(0, 5) == 0.0
    assert s(5, 5) == pytest.approx(0.05)
    assert s(9, 5) == pytest.approx(0.09)
    assert s(10, 5) == 0.1 and s(500, 5) == 0.1


def test_mlperf_step_schedule_boundaries() -> None:
    s, spe = mlperf(), 10
    assert s(0, spe) == 0.001                                  # warm-up starts at start_lr
    assert s(2 * spe, spe) == pytest.approx(0.0025)            # half way
    assert s(4 * spe - 1, spe) < 0.004
    assert s(4 * spe, spe) == 0.004                            # warm-up done: base rate
    assert s(32 * spe - 1, spe) == 0.004
    assert s(32 * spe, spe) == 0.004 * 0.25                    # first decay, at epoch 32
    assert s(64 * spe - 1, spe) == 0.004 * 0.25
    assert s(64 * spe, spe) == 0.004 * 0.125                   # not cumulative
    assert s(128 * spe, spe) == 0.004 * 0.125


def test_warmup_matches_the_mlperf_reference_at_whole_epochs() -> None:
    """mlcommons/hpc cosmoflow/utils/optimizers.py: epoch * (peak - base) / n + base."""
    s, spe = mlperf(), 13
    for epoch in range(4):
        assert s(epoch * spe, spe) == epoch * (0.004 - 0.001) / 4 + 0.001


def test_fractional_epochs_count_steps() -> None:
    s = schedule("optimizer.lr=1.0", f"{S}name=step", f"{S}decay_epochs=0.5",
                 f"{S}decay_factors=0.1")
    assert [s(step, 4) for step in range(4)] == [1.0, 1.0, 0.1, 0.1]


def test_cosine_boundaries() -> None:
    s, spe = schedule("optimizer.lr=0.1", "train.epochs=10", f"{S}name=cosine",
                      f"{S}warmup_epochs=2", f"{S}min_lr=0.001"), 4
    assert s(2 * spe, spe) == pytest.approx(0.1)
    assert s(6 * spe, spe) == pytest.approx((0.1 + 0.001) / 2)      # half way: the mean
    assert s(10 * spe, spe) == pytest.approx(0.001)
    assert s(25 * spe, spe) == pytest.approx(0.001)                 # flat after the end


def test_monotone_pieces() -> None:
    spe = 3
    step = [mlperf()(i, spe) for i in range(130 * spe)]
    warm, rest = step[: 4 * spe + 1], step[4 * spe:]
    assert all(b > a for a, b in zip(warm, warm[1:]))
    assert all(b <= a for a, b in zip(rest, rest[1:]))
    cos = schedule("optimizer.lr=0.1", "train.epochs=6", f"{S}name=cosine",
                   f"{S}warmup_epochs=1", f"{S}warmup_start_lr=0.01")
    lrs = [cos(i, spe) for i in range(8 * spe)]
    assert all(b > a for a, b in zip(lrs[:spe], lrs[1: spe + 1]))
    assert all(b < a for a, b in zip(lrs[spe: 6 * spe], lrs[spe + 1: 6 * spe + 1]))
    assert max(lrs) == pytest.approx(0.1) and min(lrs) >= 0.0


def test_pure_function_of_the_step() -> None:
    """A resumed run recomputes the rate from the step: same value, any call order."""
    s = mlperf()
    forward = [s(i, 5) for i in range(400)]
    assert [s(i, 5) for i in reversed(range(400))] == forward[::-1]


def test_rejects_negative_step() -> None:
    with pytest.raises(ValueError):
        mlperf()(-1, 5)
    with pytest.raises(ValueError):
        mlperf()(0, 0)


def test_parse_numbers() -> None:
    assert parse_numbers("k", "") == ()
    assert parse_numbers("k", " 32, 64 ") == (32.0, 64.0)
    assert parse_numbers("k", "[0.25,0.125]") == (0.25, 0.125)
    with pytest.raises(ConfigError, match="'k'.*'x' is not a finite number"):
        parse_numbers("k", "32,x")
    with pytest.raises(ConfigError, match="'inf'"):
        parse_numbers("k", "inf")


def test_yaml_scalars_become_text(tmp_path) -> None:
    """decay_epochs: 32 in YAML (an int) is accepted as the one-epoch list '32'."""
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  schedule:\n    name: step\n    decay_epochs: 32\n"
                    "    decay_factors: 0.5\n")
    s = build_schedule(load_config(path))
    assert s.decay_epochs == (32.0,) and s.decay_factors == (0.5,)


@pytest.mark.parametrize("overrides, key, words", [
    ((f"{S}name=step", f"{S}decay_epochs=64,32", f"{S}decay_factors=0.25,0.125"),
     "decay_epochs", "not strictly increasing"),
    ((f"{S}name=step", f"{S}decay_epochs=32,32", f"{S}decay_factors=0.25,0.125"),
     "decay_epochs", "not strictly increasing"),
    ((f"{S}name=step", f"{S}decay_epochs=32,64", f"{S}decay_factors=0.25"),
     "decay_factors", "has 1 value but decay_epochs has 2 values"),
    ((f"{S}name=step",), "decay_epochs", "is empty"),
    ((f"{S}name=step", f"{S}decay_epochs=0", f"{S}decay_factors=0.5"),
     "decay_epochs", "not after the start"),
    ((f"{S}name=step", f"{S}warmup_epochs=4", f"{S}decay_epochs=2",
      f"{S}decay_factors=0.5"), "decay_epochs", "inside the 4-epoch warm-up"),
    ((f"{S}name=step", f"{S}decay_epochs=8", f"{S}decay_factors=0"),
     "decay_factors", "factor <= 0"),
    ((f"{S}decay_epochs=32,64",), "decay_epochs", "name is 'constant'"),
    ((f"{S}name=cosine", f"{S}decay_factors=0.5"), "decay_factors", "name is 'cosine'"),
    ((f"{S}name=step", f"{S}decay_epochs=3", f"{S}decay_factors=0.5", f"{S}min_lr=0.1"),
     "min_lr", "name is 'step'"),
    ((f"{S}name=cosine", "train.epochs=4", f"{S}warmup_epochs=4"),
     "warmup_epochs", "leaves no epochs"),
    ((f"{S}name=cosine", "optimizer.lr=0.01", f"{S}min_lr=0.1", "train.epochs=4"),
     "min_lr", "above optimizer.lr"),
    ((f"{S}name=linear",), "name", "not allowed"),
    ((f"{S}warmup_epochs=-1",), "warmup_epochs", "below the minimum"),
])
def test_config_errors_name_the_key(overrides: tuple[str, ...], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        schedule(*overrides)
    message = str(info.value)
    assert message.startswith(f"config key '{S}{key}'")
    assert words in message
    assert "; " in message                                  # every message carries a fix


def _torch_lrs(make, steps: int, base_lr: float) -> list[float]:
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base_lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = make(opt)
        lrs = []
        for _ in range(steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    return lrs


def test_step_decay_equals_torch_multistep() -> None:
    lr_scheduler = pytest.importorskip("torch.optim.lr_scheduler")
    spe = 5
    ours = schedule("optimizer.lr=0.2", f"{S}name=step", f"{S}decay_epochs=3,7",
                    f"{S}decay_factors=0.1,0.01")
    theirs = _torch_lrs(lambda o: lr_scheduler.MultiStepLR(o, [3 * spe, 7 * spe], gamma=0.1),
                        10 * spe, 0.2)
    assert [ours(i, spe) for i in range(10 * spe)] == pytest.approx(theirs, rel=1e-12)


def test_warmup_then_step_equals_torch_sequential() -> None:
    lr_scheduler = pytest.importorskip("torch.optim.lr_scheduler")
    spe, warm = 3, 2
    ours = schedule("optimizer.lr=0.1", f"{S}name=step", f"{S}warmup_epochs={warm}",
                    f"{S}warmup_start_lr=0.01", f"{S}decay_epochs=4,6",
                    f"{S}decay_factors=0.5,0.25")

    def make(o):
        ramp = lr_scheduler.LinearLR(o, start_factor=0.1, end_factor=1.0,
                                     total_iters=warm * spe)
        decay = lr_scheduler.MultiStepLR(o, [(4 - warm) * spe, (6 - warm) * spe], gamma=0.5)
        return lr_scheduler.SequentialLR(o, [ramp, decay], milestones=[warm * spe])

    theirs = _torch_lrs(make, 9 * spe, 0.1)
    assert [ours(i, spe) for i in range(9 * spe)] == pytest.approx(theirs, rel=1e-9)


def test_warmup_then_cosine_equals_torch_sequential() -> None:
    lr_scheduler = pytest.importorskip("torch.optim.lr_scheduler")
    spe, warm, total = 4, 1, 7
    ours = schedule("optimizer.lr=0.1", f"train.epochs={total}", f"{S}name=cosine",
                    f"{S}warmup_epochs={warm}", f"{S}warmup_start_lr=0.02",
                    f"{S}min_lr=0.001")

    def make(o):
        ramp = lr_scheduler.LinearLR(o, start_factor=0.2, end_factor=1.0,
                                     total_iters=warm * spe)
        cosine = lr_scheduler.CosineAnnealingLR(o, T_max=(total - warm) * spe, eta_min=0.001)
        return lr_scheduler.SequentialLR(o, [ramp, cosine], milestones=[warm * spe])

    steps = total * spe + 1          # torch's cosine is periodic: compare up to its T_max
    theirs = _torch_lrs(make, steps, 0.1)
    assert [ours(i, spe) for i in range(steps)] == pytest.approx(theirs, rel=1e-9)
    assert math.isclose(ours(steps + 10, spe), 0.001)
