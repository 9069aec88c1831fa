"""The mutant catalogue (``catalogue.toml``): loading and checking it against the tree.

Entries are keyed by file path, not by line number, so the catalogue survives edits
around a mutated line and a move of a module is one search-and-replace of its path.  A
mutant names an ``original`` snippet that must occur exactly once in its file and the
``mutated`` text that replaces it; a snippet that no longer matches is reported as stale,
never silently skipped.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

CATALOGUE = Path(__file__).with_name("catalogue.toml")


@dataclass(frozen=True)
class Mutant:
    """One small edit of one file and the tests that should fail because of it."""

    ident: str  # "<file>#<n>": the n-th mutant of that file in the catalogue, from 1
    file: str  # path relative to the repository root
    original: str
    mutated: str
    bug: str  # the plausible bug this edit stands for
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root

    def apply(self, text: str) -> str:
        """``text`` (the file's source) with this mutant's edit made."""
        return text.replace(self.original, self.mutated, 1)


def load_catalogue(path: Path = CATALOGUE) -> list[Mutant]:
    """Every mutant of the catalogue, in its order, with its covering tests resolved:
    its own ``tests`` when it names any, else its file's entry in ``[tests]``."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    covering: dict[str, list[str]] = data.get("tests", {})
    mutants, counts = [], {}
    for entry in data.get("mutant", []):
        file = entry["file"]
        counts[file] = counts.get(file, 0) + 1
        tests = entry.get("tests") or covering.get(file)
        if not tests:
            raise ValueError(f"{path}: no tests cover {file} (add it to [tests])")
        mutants.append(Mutant(f"{file}#{counts[file]}", file, entry["original"],
                              entry["mutated"], entry["bug"], tuple(tests)))
    return mutants


def problems(mutants: list[Mutant], root: Path) -> list[str]:
    """What keeps a mutant from being applied to the tree at ``root``: a missing file or
    test file, an original that does not occur exactly once, an edit that changes
    nothing."""
    found = []
    for m in mutants:
        source = root / m.file
        if not source.is_file():
            found.append(f"{m.ident}: no file {m.file}")
            continue
        count = source.read_text(encoding="utf-8").count(m.original)
        if count != 1:
            found.append(f"{m.ident}: original occurs {count} times in {m.file} (stale)")
        if m.original == m.mutated:
            found.append(f"{m.ident}: the mutated text equals the original")
        found += [f"{m.ident}: no test file {t}" for t in m.tests
                  if not (root / t.split("::")[0]).is_file()]
    return found
