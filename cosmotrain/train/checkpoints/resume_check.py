"""Resume compatibility: may a run with this config continue from that checkpoint?

A checkpoint stores the resolved config it was written under.  ``--resume`` continues the
same trajectory only if everything that defines it is unchanged: the network (a changed
width or batch norm does not even have the same parameters), the samples and their
values, the global batch, the seed and the optimizer's update rule.  What does not change
the trajectory may change: the rank layout (any layout computes the same function), the
run's length, the learning-rate schedule, logging and checkpoint cadence, staging and
caching, the device.

Every schema key is classified explicitly in :data:`RULES` (``tests/test_resume_check.py``
fails when a key is added without a decision); a key found in neither (a key the schema no
longer has) is refused.  A key that the config does not use (``optimizer.momentum`` under
Adam, ``data.path`` with synthetic data) may change freely: see ``Rule.used_when``.

Pure: plain dicts in, a :class:`ResumeDiff` out; the caller loads the checkpoint
(``yaml.safe_load(state.config_yaml)``) and prints or raises.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cosmotrain.config.expand import PATH_KEYS  # compared normalised: runs/x/ == ./runs/x
from cosmotrain.config.load import config_to_dict
from cosmotrain.config.schema import Config
from cosmotrain.errors import UserError

ALLOW = "allow"
REFUSE = "refuse"

Tree = Mapping[str, Any]


class _Missing:
    """A key one of the two configs does not have (shown as ``unset``)."""

    def __repr__(self) -> str:
        return "unset"


MISSING: Any = _Missing()


def _get(tree: Tree, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def _is(key: str, *values: Any) -> Callable[[Tree], bool]:
    """``used_when`` predicate: the config's ``key`` is one of ``values``."""
    return lambda tree: _get(tree, key) in values


def _is_not(key: str, *values: Any) -> Callable[[Tree], bool]:
    return lambda tree: _get(tree, key) not in values


@dataclass(frozen=True)
class Rule:
    """How a change of one key (or of a whole sub-tree) is treated on resume.

    ``used_when`` says when the key has an effect at all; a key unused by both configs
    (e.g. ``model.depth`` when neither model is resnet3d) may change even if refused
    otherwise, and ``unused`` says why (shown to the user).
    """

    action: str
    why: str
    used_when: Callable[[Tree], bool] | None = None
    unused: str = ""


def _refuse(why: str, used_when: Callable[[Tree], bool] | None = None,
            unused: str = "") -> Rule:
    return Rule(REFUSE, why, used_when, unused)


def _allow(why: str) -> Rule:
    return Rule(ALLOW, why)


_RESNET = _is("model.name", "resnet3d")
_NOT_RESNET = _is_not("model.name", "resnet3d")
_FILES = _is("data.source", "files")
_SYNTHETIC = _is("data.source", "synthetic")
_SGD = _is("optimizer.name", "sgd")
_ADAM = _is("optimizer.name", "adam")
_BATCHNORM = _is("model.batchnorm", True)

_NET = "defines the network"
_SAMPLES = "changes which samples are read or their values"
_ORDER = "changes the data order or the batches"
_UPDATE = "changes the optimizer's update rule"
_LAYOUT = "rank layout: every layout computes the same function"
_CADENCE = "logging, validation or checkpoint cadence"
_LENGTH = "the length of the run"
_SCHEDULE = "learning-rate schedule"
_IO = "how samples are staged, cached or read, not which"

#: One rule per schema key (``parallel.layers`` covers its named sub-sections).
RULES: dict[str, Rule] = {
    # model: the network itself; a different one has other parameters or another function
    "model.name": _refuse(_NET),
    "model.width": _refuse(_NET),
    "model.channels": _refuse(_NET),
    "model.outputs": _refuse(_NET),
    "model.dropout": _refuse(_NET, _NOT_RESNET, "resnet3d has no dropout"),
    "model.batchnorm": _refuse(_NET),
    "model.leaky_slope": _refuse(_NET, _NOT_RESNET, "resnet3d uses ReLU"),
    "model.block": _refuse(_NET, _RESNET, "only resnet3d uses it"),
    "model.depth": _refuse(_NET, _RESNET, "only resnet3d uses it"),
    "model.base_channels": _refuse(_NET, _RESNET, "only resnet3d uses it"),
    # data: which samples, their values and their order are part of the trajectory
    "data.source": _refuse(_SAMPLES),
    "data.path": _refuse(_SAMPLES, _FILES, "data.source is synthetic"),
    "data.format": _refuse(_SAMPLES, _FILES, "data.source is synthetic"),
    "data.reader": _allow("preload and direct read the same samples in the same order"),
    "data.transform": _refuse(_SAMPLES),
    "data.shuffle": _refuse(_ORDER),
    "data.drop_last": _refuse(_ORDER),
    "data.prefetch": _allow(_IO),
    "data.memory_fraction": _allow(_IO),
    "data.stage_dir": _allow(_IO),
    "data.cache_dir": _allow(_IO),
    "data.verify": _allow("checks the files against their checksums, reads the same samples"),
    "data.synthetic.samples": _refuse(_SAMPLES, _SYNTHETIC, "data.source is files"),
    "data.synthetic.seed": _refuse(_SAMPLES, _SYNTHETIC, "data.source is files"),
    "data.synthetic.val_fraction": _refuse(_SAMPLES, _SYNTHETIC, "data.source is files"),
    # parallel: the layout, except batch-norm statistics over a sample group's share only
    "parallel.sample": _allow(_LAYOUT),
    "parallel.channel": _allow(_LAYOUT),
    "parallel.filter": _allow(_LAYOUT),
    "parallel.channel_algorithm": _allow(_LAYOUT),
    "parallel.layers": _allow(_LAYOUT),
    "parallel.depth": _allow(_LAYOUT),
    "parallel.height": _allow(_LAYOUT),
    "parallel.width": _allow(_LAYOUT),
    "parallel.spatial_until": _allow(_LAYOUT),
    "parallel.bn_statistics": _refuse("changes what batch normalisation computes",
                                      _BATCHNORM, "model.batchnorm is off"),
    "parallel.bucket_mb": _allow(_LAYOUT),
    "parallel.shard_optimizer": _allow("a checkpoint holds the full, unsharded optimizer "
                                       "state: any sharding resumes from any other"),
    "parallel.auto": _allow(_LAYOUT),
    "parallel.machine": _allow(_LAYOUT),
    # train
    "train.batch_size": _refuse("the global mini-batch defines the steps and the epochs"),
    "train.epochs": _allow(_LENGTH),
    "train.max_steps": _allow(_LENGTH),
    "train.seed": _refuse("seeds initialisation, data order and dropout"),
    "train.validate_every": _allow(_CADENCE),
    "train.target_mae": _allow("an early-stopping threshold"),
    "train.checkpoint_every_epochs": _allow(_CADENCE),
    "train.checkpoint_every_steps": _allow(_CADENCE),
    "train.keep_checkpoints": _allow(_CADENCE),
    "train.log_every": _allow(_CADENCE),
    "train.watchdog_s": _allow(_CADENCE),
    # optimizer: the update rule is refused, the learning rate and its schedule may change
    "optimizer.name": _refuse(_UPDATE),
    "optimizer.lr": _allow(_SCHEDULE),
    "optimizer.momentum": _refuse(_UPDATE, _SGD, "optimizer.name is adam"),
    "optimizer.weight_decay": _refuse(_UPDATE),
    "optimizer.beta1": _refuse(_UPDATE, _ADAM, "optimizer.name is sgd"),
    "optimizer.beta2": _refuse(_UPDATE, _ADAM, "optimizer.name is sgd"),
    "optimizer.eps": _refuse(_UPDATE, _ADAM, "optimizer.name is sgd"),
    "optimizer.schedule.name": _allow(_SCHEDULE),
    "optimizer.schedule.warmup_epochs": _allow(_SCHEDULE),
    "optimizer.schedule.warmup_start_lr": _allow(_SCHEDULE),
    "optimizer.schedule.decay_epochs": _allow(_SCHEDULE),
    "optimizer.schedule.decay_factors": _allow(_SCHEDULE),
    "optimizer.schedule.min_lr": _allow(_SCHEDULE),
    # output: the checkpoint was found in the current output.dir, so a different saved
    # dir means the run directory was moved or copied (its synthetic data moved with it)
    "output.dir": _allow("the run directory moved"),
    "output.tensorboard": _allow("a log of the run, not its trajectory"),
    "output.mlperf_log": _allow("a log of the run, not its trajectory"),
    "output.mlperf.org": _allow("what the MLPerf log reports, not the trajectory"),
    "output.mlperf.division": _allow("what the MLPerf log reports, not the trajectory"),
    "output.mlperf.status": _allow("what the MLPerf log reports, not the trajectory"),
    "output.mlperf.platform": _allow("what the MLPerf log reports, not the trajectory"),
    # device: where and in which precision the same function is computed
    "device.backend": _allow("the device"),
    "device.precision": _allow("the device's arithmetic"),
    "device.conv_algorithm": _allow("the device"),
    "device.cudnn_autotune": _allow("the device"),
    "device.conv1_channels_pad": _allow("the device"),
    "device.conv1_algorithm": _allow("the device"),
    "device.communication": _allow("the device"),
    "device.gpus_per_node": _allow("the device"),
    "device.reuse_freed_memory": _allow("the host allocator"),
    "device.plan_step_memory": _allow("the host allocator"),
    "device.cuda_graph": _allow("how the same step is launched"),
    "device.cuda_graph_warmup": _allow("how the same step is launched"),
}

#: Keys found in no rule (a key the schema no longer declares) are refused.
UNKNOWN = _refuse("not a key this version of cosmotrain knows")


def rule_for(key: str) -> Rule:
    """The rule of a dotted key: its own entry, else its nearest section's, else refuse."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:end]))
        if rule is not None:
            return rule
    return UNKNOWN


class Change(NamedTuple):
    """One key whose value differs: ``(dotted key, old (saved) value, new value)``."""

    key: str
    old: Any
    new: Any


@dataclass
class ResumeDiff:
    """The differences between a checkpoint's config and the current one, classified."""

    refused: list[Change] = field(default_factory=list)
    allowed: list[Change] = field(default_factory=list)
    #: why an allowed change of an otherwise refused key is harmless, by key
    notes: dict[str, str] = field(default_factory=dict)
    #: warnings that an allowed change still alters the trajectory (local shuffle / BN)
    caveats: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing refused differs: the resume may go on."""
        return not self.refused

    def refusal_message(self, checkpoint_path: object, limit: int = 8) -> str:
        """One line naming every refused change (the first ``limit``) and the fix."""
        shown = ", ".join(f"{c.key} ({show(c.old)} -> {show(c.new)})"
                          for c in self.refused[:limit])
        if len(self.refused) > limit:
            shown += f" and {len(self.refused) - limit} more"
        return (f"cannot resume from '{checkpoint_path}': the config differs in {shown}; "
                f"resume with the checkpoint's settings (its config is stored in the "
                f"checkpoint and in output.dir/config.yaml) or start a new run in another "
                f"output.dir")

    def allowed_lines(self) -> list[str]:
        """One line per allowed change, e.g. ``resume: parallel.depth 1 -> 2``."""
        lines = []
        for c in self.allowed:
            note = f" ({self.notes[c.key]})" if c.key in self.notes else ""
            lines.append(f"resume: {c.key} {show(c.old)} -> {show(c.new)}{note}")
        return lines + [f"resume: note: {caveat}" for caveat in self.caveats]

    def raise_if_refused(self, checkpoint_path: object) -> None:
        """Raise the one-line :class:`UserError` when a refused key differs."""
        if self.refused:
            raise UserError(self.refusal_message(checkpoint_path))


def compare_for_resume(saved: Tree, current: Tree) -> ResumeDiff:
    """Classify every difference between the checkpoint's config and the current one.

    Both are configs as nested plain dicts.  A key either lacks (a checkpoint written by an
    older cosmotrain) is taken at its schema default, which is what that version did.
    """
    saved, current = _with_defaults(saved), _with_defaults(current)
    diff = ResumeDiff()
    for key, old, new in _differences(saved, current):
        rule = rule_for(key)
        if rule.action == ALLOW:
            diff.allowed.append(Change(key, old, new))
        elif rule.used_when is not None and not (rule.used_when(saved)
                                                 or rule.used_when(current)):
            diff.allowed.append(Change(key, old, new))
            diff.notes[key] = f"unused: {rule.unused}"
        else:
            diff.refused.append(Change(key, old, new))
    diff.caveats = _layout_caveats(diff, current)
    return diff


def _layout_caveats(diff: ResumeDiff, current: Tree) -> list[str]:
    """Settings under which a layout change does change the trajectory (by design)."""
    if not any(c.key.startswith("parallel.") for c in diff.allowed):
        return []
    caveats = []
    if _get(current, "data.shuffle") == "local":
        caveats.append("data.shuffle is local: the data order depends on the number of "
                       "sample groups, so a changed parallel.sample changes the trajectory")
    if _get(current, "model.batchnorm") is True and \
            _get(current, "parallel.bn_statistics") == "local":
        caveats.append("parallel.bn_statistics is local: batch-norm statistics depend on "
                       "the sample groups, so a changed layout changes the trajectory")
    return caveats


def _with_defaults(tree: Tree) -> dict[str, Any]:
    """``tree`` with every schema key it lacks filled in at the schema default."""
    merged = config_to_dict(Config())
    _merge(merged, tree)
    return merged


def _merge(base: dict[str, Any], extra: Tree) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and base[key]:
            _merge(base[key], value)
        else:  # a leaf, or a mapping of named sub-sections (parallel.layers): taken whole
            base[key] = value


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for every leaf; an empty mapping is a leaf of its own."""
    if isinstance(tree, Mapping) and tree:
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif prefix:
        yield prefix.rstrip("."), tree


def _differences(saved: Tree, current: Tree) -> Iterator[tuple[str, Any, Any]]:
    old, new = dict(_leaves(saved)), dict(_leaves(current))
    for key in list(old) + [k for k in new if k not in old]:
        before, after = old.get(key, MISSING), new.get(key, MISSING)
        if _empty_mapping(before) and after is MISSING or \
                _empty_mapping(after) and before is MISSING:
            continue  # {} on one side, its absent sub-keys on the other: both say "none"
        if not same_value(key, before, after):
            yield key, before, after


def _empty_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and not value


def same_value(key: str, a: Any, b: Any) -> bool:
    """Equal as config values: 4 == 4.0, paths compared normalised, bools not numbers."""
    if a is MISSING or b is MISSING:
        return a is b
    if key in PATH_KEYS and isinstance(a, str) and isinstance(b, str):
        return os.path.normpath(a) == os.path.normpath(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def show(value: Any, width: int = 40) -> str:
    """A value as a user would write it in YAML or ``--set``: compact, at most ``width``
    characters (0: no limit)."""
    if value is MISSING:
        text = "unset"
    elif value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}" if float(f"{value:g}") == value else repr(value)
    elif isinstance(value, str):
        text = value if value.strip() == value and value else repr(value)
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k}: {show(v, width)}" for k, v in value.items()) + "}"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(show(v, width) for v in value) + "]"
    else:
        text = str(value)
    return text if not width or len(text) <= width else text[: width - 3] + "..."
