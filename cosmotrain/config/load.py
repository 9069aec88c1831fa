"""Load a YAML config, apply ``--set key=value`` overrides and validate against the schema.

Validation is strict and names the dotted key path in every message: unknown keys (with a
did-you-mean suggestion), wrong types and out-of-range values are :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from cosmotrain.config.device import check_device
from cosmotrain.config.expand import expand_path_keys
from cosmotrain.config.schema import AUTO, Config
from cosmotrain.errors import ConfigError, UserError

_NULL_WORDS = {"null", "none", "~", ""}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


def load_config(path: str | Path | None, overrides: Iterable[str] = (),
                env: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (or start from the defaults when None), apply overrides, validate.

    ``env`` (the command line passes the process environment) expands ``${VAR}`` in the
    path keys (``config/expand.py``); None, a library caller's default, expands nothing.
    """
    raw = read_yaml(Path(path)) if path is not None else {}
    return config_from_mapping(raw, overrides, env)


def config_from_mapping(raw: dict[str, Any], overrides: Iterable[str] = (),
                        env: Mapping[str, str] | None = None) -> Config:
    """Validate a parsed config (e.g. a checkpoint's) after applying ``key=value`` overrides
    (and expanding ``${VAR}`` in the path keys from ``env`` when given)."""
    for assignment in overrides:
        key, value = parse_assignment(assignment)
        if key.startswith("parallel.") and raw.get("parallel") == AUTO:
            raw["parallel"] = {"auto": True}
        set_dotted(raw, key, value)
    if raw.get("parallel") == AUTO:  # `parallel: auto`: the planner chooses
        raw["parallel"] = {"auto": True}
    _expand_backend(raw)
    expand_path_keys(raw, env)
    cfg = build(Config, raw, prefix="")
    check_device(cfg.device)
    return cfg


def _expand_backend(raw: dict[str, Any]) -> None:
    """``backend: gpu`` at the top level is short for ``device: {backend: gpu}``."""
    if "backend" not in raw:
        return
    value = raw.pop("backend")
    device = raw.setdefault("device", {})
    if not isinstance(device, dict):
        raise ConfigError("device", f"expected a mapping of keys, got {device!r}")
    if "backend" in device and device["backend"] != value:
        raise ConfigError("backend", f"{value!r} contradicts device.backend: "
                          f"{device['backend']!r}", "set only one of them")
    device["backend"] = value


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse a YAML file into a mapping, turning every failure into a one-line UserError.

    The file must be UTF-8 (a byte-order mark is allowed) and may not give a key twice in
    one mapping: PyYAML would silently keep the last value.
    """
    if path.is_dir():
        raise UserError(f"config file '{path}' is a directory; pass a YAML file to --config "
                        f"(e.g. {path / 'cosmoflow-128.yaml'})")
    if not path.is_file():
        raise UserError(f"config file '{path}' not found; pass an existing YAML file to --config")
    text = _read_text(path)
    try:
        _check_duplicate_keys(path, yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise UserError(f"config file '{path}': {problem}{where}; fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file '{path}': the top level must be a mapping of sections "
                        f"(model, data, parallel, train, optimizer, output, device)")
    return data


def _read_text(path: Path) -> str:
    """The file's text, decoded as UTF-8; a one-line UserError when it cannot be."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise UserError(f"config file '{path}' cannot be read ({err.strerror or err}); "
                        f"check its permissions") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise UserError(f"config file '{path}' is not UTF-8 text (byte 0x{raw[err.start]:02x} "
                        f"at line {line}); save it with UTF-8 encoding") from None


def _check_duplicate_keys(path: Path, node: yaml.Node | None, prefix: str = "",
                          seen_nodes: set[int] | None = None) -> None:
    """Reject a key given twice in one mapping, naming its dotted path and both lines."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # an alias of a node already checked (or a recursive one)
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicate_keys(path, item, prefix, seen_nodes)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node,
                                                                        yaml.ScalarNode):
            continue
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(key, f"is given twice in config file '{path}' (lines "
                              f"{seen[key]} and {line})",
                              "keep one of them (YAML would silently use the last)")
        seen[key] = line
        _check_duplicate_keys(path, value_node, f"{key}.", seen_nodes)


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """Split ``key=value``; the value is parsed as a YAML scalar (types are checked later)."""
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set '{assignment}': expected KEY=VALUE with a dotted key, "
                        f"e.g. --set train.batch_size=8")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key, value


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Assign ``value`` at a dotted path, creating the intermediate mappings."""
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section",
                              f"set one of its keys instead of '{key}'")
        node = child
    node[parts[-1]] = value


def known_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key path the schema declares (used for did-you-mean suggestions)."""
    keys = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        hint = typing.get_type_hints(cls)[f.name]
        keys.extend(known_keys(hint, path + ".") if dataclasses.is_dataclass(hint) else [path])
    return keys


def build(cls: type, raw: Any, prefix: str) -> Any:
    """Recursively build dataclass ``cls`` from mapping ``raw``, validating every key."""
    section = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, Mapping):
        raise ConfigError(section, f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            siblings = [f"{prefix}{name}" for name in names]
            raise ConfigError(f"{prefix}{key}", "unknown key",
                              _suggest(f"{prefix}{key}", siblings))
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = build(hints[f.name], raw[f.name], path + ".")
        elif _mapping_of(hints[f.name]) is not None:
            values[f.name] = _build_mapping(_mapping_of(hints[f.name]), raw[f.name], path)
        else:
            values[f.name] = check_value(path, raw[f.name], hints[f.name], f.metadata)
    return cls(**values)


def _mapping_of(hint: Any) -> type | None:
    """The section type ``X`` of a ``dict[str, X]`` key (named sub-sections), else None."""
    if typing.get_origin(hint) is dict:
        value = typing.get_args(hint)[1]
        return value if dataclasses.is_dataclass(value) else None
    return None


def _build_mapping(cls: type, raw: Any, path: str) -> dict[str, Any]:
    """Named sub-sections, e.g. ``parallel.layers: {conv1: {algorithm: y}}``."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping of names to sections, got {raw!r}",
                          "e.g. {conv1: {algorithm: y}}")
    return {str(name): build(cls, value if value is not None else {}, f"{path}.{name}.")
            for name, value in raw.items()}


def _suggest(path: str, siblings: list[str]) -> str:
    """A did-you-mean: a sibling with a similar name, else the same name in another section."""
    leaf = path.rsplit(".", 1)[-1]
    by_leaf = {key.rsplit(".", 1)[-1]: key for key in siblings}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    if close:
        return f"did you mean '{by_leaf[close[0]]}'?"
    elsewhere = [key for key in known_keys() if key.rsplit(".", 1)[-1] == leaf]
    if elsewhere:
        return f"did you mean '{elsewhere[0]}'?"
    return "valid keys here: " + ", ".join(sorted(siblings))


def check_value(path: str, value: Any, hint: Any, meta: Mapping[str, Any]) -> Any:
    """Coerce ``value`` to the declared type and enforce choices and range."""
    if meta.get("nullable") and (value is None or _is_word(value, _NULL_WORDS)):
        return None
    if meta.get("auto") and _is_word(value, {AUTO}):
        return AUTO
    base = _base_type(hint)
    if meta.get("number_list") and isinstance(value, (list, tuple)):
        value = _number_list_text(path, value)
    value = coerce(path, value, base, meta)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        listed = ", ".join(str(c) for c in choices)
        raise ConfigError(path, f"{value!r} is not allowed", f"choose one of: {listed}")
    _check_range(path, value, meta)
    return value


def _number_list_text(path: str, items: Sequence[Any]) -> str:
    """A YAML list of numbers (``[32, 64]``) as the key's comma-separated text ``'32,64'``:
    one stored form, whichever way it was written."""
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ConfigError(path, f"expected a list of numbers, got {list(items)!r}",
                              "write e.g. [32, 64] or '32,64'")
    return ",".join(str(item) for item in items)


def _is_word(value: Any, words: set[str]) -> bool:
    return isinstance(value, str) and value.strip().lower() in words


def _base_type(hint: Any) -> type:
    """The concrete scalar type of an annotation such as ``int | None`` or ``int | str``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def coerce(path: str, value: Any, base: type, meta: Mapping[str, Any]) -> Any:
    """Convert a YAML/--set value to ``base`` or raise a ConfigError naming the key."""
    extra = " or auto" if meta.get("auto") else ""
    extra += " or null" if meta.get("nullable") else ""
    expected = {bool: "true or false", int: "an integer", float: "a number",
                str: "a string"}[base] + extra
    try:
        return _COERCERS[base](value)
    except (TypeError, ValueError):
        raise ConfigError(path, f"expected {expected}, got {value!r}") from None


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if _is_word(value, _TRUE_WORDS):
        return True
    if _is_word(value, _FALSE_WORDS):
        return False
    raise ValueError(value)


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    raise TypeError(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise TypeError(value)


def _to_str(value: Any) -> str:
    if isinstance(value, (bool, dict, list)) or value is None:
        raise TypeError(value)
    return str(value)


_COERCERS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _check_range(path: str, value: Any, meta: Mapping[str, Any]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if not math.isfinite(value):  # nan passes every comparison, inf every maximum-less range
        raise ConfigError(path, f"{value} is not a finite number", "use a finite value")
    low, high = meta.get("minimum"), meta.get("maximum")
    if low is not None and value < low:
        raise ConfigError(path, f"{value} is below the minimum {low}", f"use a value >= {low}")
    if high is not None:
        if meta.get("exclusive_max") and value >= high:
            raise ConfigError(path, f"{value} is out of range", f"use a value < {high}")
        if value > high:
            raise ConfigError(path, f"{value} is above the maximum {high}",
                              f"use a value <= {high}")


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain nested dicts (for YAML/JSON output and checkpoints)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML text, sections in schema order."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_resolved(cfg: Config, out_dir: str | Path, name: str = "config.yaml") -> Path:
    """Write the resolved config into ``out_dir`` atomically (temporary file, then rename),
    mode 0644 (less the umask); a directory or disk that refuses it is a WriteError, and no
    temporary file is left behind."""
    from cosmotrain.files.atomic import check_writable, write_text_atomically

    out = check_writable(out_dir)
    return write_text_atomically(out / name, dump_yaml(cfg))
