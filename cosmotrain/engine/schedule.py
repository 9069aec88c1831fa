"""Learning-rate schedules: the rate as a pure function of ``(step, steps_per_epoch)``.

The rate depends on nothing but the step counter, so a resumed run (under any rank count or
parallel strategy) recomputes exactly the rate of the uninterrupted run and the schedule
needs no checkpointed state.  ``step`` is the number of optimizer steps already taken (0 for
the first update) and ``t = step / steps_per_epoch`` the fractional epochs completed.

After an optional linear warm-up over ``W = warmup_epochs`` epochs, from ``warmup_start_lr``
(``s``) to ``optimizer.lr`` (``b``), every schedule is one of::

    warm-up   t <  W : lr = s + (b - s) * t / W
    constant  t >= W : lr = b
    step      t >= W : lr = b * f_i  for the last decay epoch e_i <= t  (b before e_1)
    cosine    t >= W : lr = m + (b - m) * (1 + cos(pi * min(1, (t - W) / (T - W)))) / 2

with ``T = train.epochs`` and ``m = min_lr``.  The step schedule is the MLPerf HPC CosmoFlow
reference's (mlcommons/hpc, ``cosmoflow/configs/cosmo.yaml``: ``n_warmup_epochs: 4``,
``decay_schedule: {32: 0.25, 64: 0.125}``; ``cosmoflow/utils/optimizers.py``,
``_lr_schedule``): the factors scale the base rate, they are not cumulative (0.125 x b from
epoch 64, not 0.25 x 0.125 x b).  Two deliberate differences from that Keras code, which
sets the rate once per epoch: the warm-up here advances every step (at whole epochs it gives
the reference's values), and a decay epoch ``e`` takes effect once ``e`` epochs are complete
(``torch.optim.lr_scheduler.MultiStepLR``'s convention) where the reference's strict
``e < epoch`` waits one epoch more.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from cosmotrain.config.schema import Config
from cosmotrain.errors import ConfigError

KEY = "optimizer.schedule"


@dataclass(frozen=True)
class LRSchedule:
    """A validated schedule; call it with ``(step, steps_per_epoch)`` for the rate.

    Build it with :func:`build_schedule`, which checks the config and names the bad key.
    """

    name: str
    base_lr: float
    warmup_epochs: float = 0.0
    warmup_start_lr: float = 0.0
    decay_epochs: tuple[float, ...] = ()
    decay_factors: tuple[float, ...] = ()
    min_lr: float = 0.0
    total_epochs: float = 1.0

    def __call__(self, step: int, steps_per_epoch: int) -> float:
        return learning_rate(self, step, steps_per_epoch)


def learning_rate(schedule: LRSchedule, step: int, steps_per_epoch: int) -> float:
    """The rate of optimizer step ``step`` (0-based) with ``steps_per_epoch`` steps an epoch."""
    if step < 0 or steps_per_epoch < 1:
        raise ValueError(f"need step >= 0 and steps_per_epoch >= 1, got {step}, "
                         f"{steps_per_epoch}")
    epochs = step / steps_per_epoch
    s = schedule
    if epochs < s.warmup_epochs:
        return warmup_lr(epochs, s.warmup_start_lr, s.base_lr, s.warmup_epochs)
    if s.name == "step":
        return step_decay_lr(epochs, s.base_lr, s.decay_epochs, s.decay_factors)
    if s.name == "cosine":
        return cosine_lr(epochs, s.base_lr, s.min_lr, s.warmup_epochs, s.total_epochs)
    return s.base_lr


def warmup_lr(epochs: float, start_lr: float, base_lr: float, warmup_epochs: float) -> float:
    """Linear from ``start_lr`` at 0 to ``base_lr`` at ``warmup_epochs`` (MLPerf's op order)."""
    return epochs * (base_lr - start_lr) / warmup_epochs + start_lr


def step_decay_lr(epochs: float, base_lr: float, decay_epochs: tuple[float, ...],
                  factors: tuple[float, ...]) -> float:
    """``base_lr`` times the factor of the last decay epoch reached (``base_lr`` before)."""
    reached = bisect_right(decay_epochs, epochs)
    return base_lr if reached == 0 else base_lr * factors[reached - 1]


def cosine_lr(epochs: float, base_lr: float, min_lr: float, start: float, end: float
              ) -> float:
    """Half a cosine from ``base_lr`` at epoch ``start`` to ``min_lr`` at ``end``, then flat."""
    progress = min(1.0, (epochs - start) / (end - start))
    return min_lr + (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0


def build_schedule(cfg: Config) -> LRSchedule:
    """The schedule of ``cfg.optimizer.schedule``; a ConfigError names any inconsistent key."""
    sc = cfg.optimizer.schedule
    epochs = parse_numbers(f"{KEY}.decay_epochs", sc.decay_epochs)
    factors = parse_numbers(f"{KEY}.decay_factors", sc.decay_factors)
    _check_unused(sc.name, epochs, factors, sc.min_lr)
    if sc.name == "step":
        _check_step(epochs, factors, sc.warmup_epochs)
    if sc.name == "cosine":
        _check_cosine(sc.warmup_epochs, cfg.train.epochs, sc.min_lr, cfg.optimizer.lr)
    return LRSchedule(sc.name, cfg.optimizer.lr, sc.warmup_epochs, sc.warmup_start_lr,
                      epochs, factors, sc.min_lr, float(cfg.train.epochs))


def parse_numbers(key: str, text: str) -> tuple[float, ...]:
    """``'32, 64'`` -> ``(32.0, 64.0)``: the key's stored text (the loader stores a YAML
    list ``[32, 64]`` as ``'32,64'`` too, so configs and checkpoints hold one form)."""
    body = text.strip().removeprefix("[").removesuffix("]")
    values = []
    for item in (part.strip() for part in body.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ConfigError(key, f"{item!r} is not a finite number",
                              "write comma-separated numbers, e.g. '32,64'")
        values.append(value)
    return tuple(values)


def _check_unused(name: str, epochs: tuple[float, ...], factors: tuple[float, ...],
                  min_lr: float) -> None:
    """Keys of another schedule are a mistake (a forgotten ``name``), not silently ignored."""
    unused = []
    if name != "step":
        unused += [key for key, vals in (("decay_epochs", epochs), ("decay_factors", factors))
                   if vals]
    if name != "cosine" and min_lr != 0.0:
        unused.append("min_lr")
    if unused:
        owner = "cosine" if unused[0] == "min_lr" else "step"
        raise ConfigError(f"{KEY}.{unused[0]}", f"is set but {KEY}.name is {name!r}",
                          f"set {KEY}.name={owner} or remove {unused[0]}")


def _check_step(epochs: tuple[float, ...], factors: tuple[float, ...],
                warmup_epochs: float) -> None:
    if not epochs:
        raise ConfigError(f"{KEY}.decay_epochs", "is empty but the step schedule needs it",
                          "give the decay epochs, e.g. '32,64' (or use name=constant)")
    if len(factors) != len(epochs):
        raise ConfigError(f"{KEY}.decay_factors", f"has {_count(factors)} but "
                          f"decay_epochs has {_count(epochs)}", "give one factor per decay "
                          "epoch, e.g. decay_epochs='32,64' decay_factors='0.25,0.125'")
    if any(b <= a for a, b in zip(epochs, epochs[1:])):
        raise ConfigError(f"{KEY}.decay_epochs", f"{_text(epochs)} is not strictly "
                          "increasing", "list each epoch once, in increasing order")
    if epochs[0] <= 0:
        raise ConfigError(f"{KEY}.decay_epochs", f"the first decay epoch {epochs[0]:g} is "
                          "not after the start of training", "use epochs > 0")
    if epochs[0] < warmup_epochs:
        raise ConfigError(f"{KEY}.decay_epochs", f"the first decay epoch {epochs[0]:g} falls "
                          f"inside the {warmup_epochs:g}-epoch warm-up",
                          f"decay at epochs >= {KEY}.warmup_epochs")
    if any(f <= 0 for f in factors):
        raise ConfigError(f"{KEY}.decay_factors", f"{_text(factors)} has a factor <= 0",
                          "use positive factors of optimizer.lr, e.g. '0.25,0.125'")


def _check_cosine(warmup_epochs: float, total_epochs: int, min_lr: float, lr: float) -> None:
    if warmup_epochs >= total_epochs:
        raise ConfigError(f"{KEY}.warmup_epochs", f"{warmup_epochs:g} leaves no epochs of "
                          f"the {total_epochs} in train.epochs for the cosine decay",
                          "shorten the warm-up or raise train.epochs")
    if min_lr > lr:
        raise ConfigError(f"{KEY}.min_lr", f"{min_lr:g} is above optimizer.lr ({lr:g})",
                          "use a min_lr <= optimizer.lr")


def _count(values: tuple[float, ...]) -> str:
    return f"{len(values)} value" + ("" if len(values) == 1 else "s")


def _text(values: tuple[float, ...]) -> str:
    return "'" + ",".join(f"{v:g}" for v in values) + "'"
