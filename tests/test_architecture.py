"""The architecture's rules, checked: imports flow one way, modules stay small.

The import contract lives in pyproject.toml (``[tool.importlinter]``, docs/ARCHITECTURE.md);
import-linter's graph counts imports inside functions too, so a cycle cannot hide in a
function body.  A copy of the package with one upward import proves the check bites.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "cosmotrain"
MAX_LINES = 400


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package found first on the path under ``root``."""
    program = Path(sys.executable).parent / "lint-imports"
    if not program.exists():
        pytest.skip("import-linter is not installed: pip install -e '.[test]'")
    return subprocess.run([str(program), "--no-cache", "--config", str(REPO / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": str(program.parent)},
                          capture_output=True, text=True, timeout=120)


def test_imports_flow_one_way() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_an_upward_import_inside_a_function_is_caught(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "cosmotrain",
                    ignore=shutil.ignore_patterns("__pycache__"))
    tensor = tmp_path / "cosmotrain" / "tensor" / "__init__.py"
    tensor.write_text(tensor.read_text() + "\n\ndef _upward():\n"
                      "    from cosmotrain.train import trainer  # noqa: F401\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0 and "cosmotrain.tensor" in done.stdout


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


# Environment reads allowed below the CLI: process facts, not user settings
# (docs/ARCHITECTURE.md, "Who reads the environment").
ENVIRONMENT_READERS = {
    "cosmotrain/__init__.py",  # OpenBLAS's idle spin, set before numpy loads OpenBLAS
    "cosmotrain/cli/app.py",  # the user's settings: machine file, cache directory
    "cosmotrain/cli/run.py",  # the job id and the fault hook
    "cosmotrain/runtime/threads.py",  # the thread variables the BLAS pool obeys
    "cosmotrain/study/launch.py",  # the environment a launched job inherits
    "cosmotrain/study/scale.py",  # the thread and Slurm variables a study records
    "cosmotrain/info.py",  # CUDA_VISIBLE_DEVICES, reported as found
}


def test_only_the_cli_and_process_facts_read_the_environment() -> None:
    readers = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
               if "os.environ" in (text := p.read_text()) or "getenv" in text}
    assert readers <= ENVIRONMENT_READERS, (
        f"read the environment in cli.py and pass the value down: "
        f"{sorted(readers - ENVIRONMENT_READERS)}")
