"""The mutation check's own machinery (``python -m mutation``, docs/TESTING.md).

The check itself is not part of ``pytest``.  Two things are: the catalogue still applies
to this tree (every file and test file exists, every original snippet occurs exactly
once), so an edit that makes a mutant stale is caught here rather than at the next run;
and the runner tells a killed mutant from a survivor and restores what it mutated, tried
on a two-file repository made for the test (three pytest runs: about 8 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO


@pytest.fixture
def mutation(monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("tomllib")  # the catalogue's reader: Python 3.11 and later
    monkeypatch.syspath_prepend(str(REPO))
    import mutation.catalogue
    import mutation.runner

    return mutation


def test_the_catalogue_applies_to_this_tree(mutation) -> None:
    mutants = mutation.catalogue.load_catalogue()
    assert mutation.catalogue.problems(mutants, REPO) == []
    assert len(mutants) >= 60 and len({m.ident for m in mutants}) == len(mutants)
    assert all(m.file.startswith("cosmotrain/") and m.bug for m in mutants)


def test_the_runner_tells_killed_from_survived_and_restores(mutation, tmp_path: Path
                                                            ) -> None:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("")
    source = "def f() -> int:\n    return 1\n"
    (repo / "pkg" / "m.py").write_text(source)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_m.py").write_text(
        "from pkg.m import f\n\n\ndef test_f():\n    assert f() == 1\n")
    catalogue = tmp_path / "catalogue.toml"
    catalogue.write_text(
        '[tests]\n"pkg/m.py" = ["tests/test_m.py"]\n\n'
        '[[mutant]]\nfile = "pkg/m.py"\nbug = "off by one"\n'
        'original = "return 1"\nmutated = "return 2"\n\n'
        '[[mutant]]\nfile = "pkg/m.py"\nbug = "equivalent"\n'
        'original = "return 1"\nmutated = "return 1  # the same"\n')
    mutants = mutation.catalogue.load_catalogue(catalogue)
    assert mutation.catalogue.problems(mutants, repo) == []
    seen = []
    failures, outcomes = mutation.runner.run_all(repo, mutants, 60.0, 1, seen.append)
    assert failures == [] and seen == outcomes
    assert [(o.mutant.ident, o.verdict) for o in outcomes] == [
        ("pkg/m.py#1", "killed"), ("pkg/m.py#2", "survived")]
    assert (repo / "pkg" / "m.py").read_text() == source


def test_a_stale_snippet_or_a_missing_test_file_is_reported(mutation, tmp_path: Path
                                                            ) -> None:
    (tmp_path / "m.py").write_text("X = 1\n")
    stale = mutation.catalogue.Mutant("m.py#1", "m.py", "X = 2", "X = 3", "stale",
                                      ("tests/test_m.py::test_x",))
    assert mutation.catalogue.problems([stale], tmp_path) == [
        "m.py#1: original occurs 0 times in m.py (stale)",
        "m.py#1: no test file tests/test_m.py::test_x"]
