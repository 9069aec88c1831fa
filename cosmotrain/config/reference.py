"""The config reference (markdown), generated from the schema's declarations."""

from __future__ import annotations

import dataclasses
import typing

from cosmotrain.config.schema import Config


def reference_rows(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every key, in schema order."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(reference_rows(hints[f.name], path + "."))
            continue
        if f.default is dataclasses.MISSING:  # named sub-sections: a row for the map, its keys
            rows.append((path, "mapping", "{}", _doc_text(f)))
            rows.extend(reference_rows(typing.get_args(hints[f.name])[1], path + ".<name>."))
            continue
        rows.append((path, _type_text(f), repr(f.default) if f.default is None
                     else str(f.default), _doc_text(f)))
    return rows


def _type_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    if meta.get("choices"):
        return " \\| ".join(str(c) for c in meta["choices"])
    if meta.get("number_list"):
        return "list \\| str"
    return str(f.type).replace("|", "\\|")


def _doc_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    doc = meta["doc"]
    low, high = meta.get("minimum"), meta.get("maximum")
    if low is not None or high is not None:
        closing = ")" if meta.get("exclusive_max") else "]"
        doc += f" (range [{low if low is not None else '-inf'}, "
        doc += f"{high if high is not None else 'inf'}{closing})"
    return doc


def reference_markdown() -> str:
    """A markdown table of every key: the README's config reference."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | `{d}` | {doc} |" for k, t, d, doc in reference_rows()]
    return "\n".join(lines)
