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
MAX_MODULES = 15  # per folder, before it wants rooms of its own


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package found first on the path under ``root``."""
    program = Path(sys.executable).parent / "lint-imports"
    if not program.exists():
        pytest.skip("import-linter is not installed: pip install -e '.[test]'")
    return subprocess.run([str(program), "--no-cache", "--config", str(REPO / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": str(program.parent)},
                          capture_output=True, text=True, timeout=120)


CONTRACTS = 4  # [tool.importlinter] in pyproject.toml


def test_imports_flow_one_way() -> None:
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"{CONTRACTS} kept, 0 broken" in done.stdout


# One planted violation of each contract (and of each new line of the layers): the file it
# goes into, the import, and the contract's name as lint-imports reports it broken.
PLANTED = {
    "upward-in-a-function": ("tensor/__init__.py", "from cosmotrain.train import trainer",
                             "import only the packages below them"),
    "engine-imports-train": ("engine/__init__.py", "from cosmotrain.train import trainer",
                             "import only the packages below them"),
    "comm-imports-kernels": ("comm/__init__.py", "from cosmotrain.kernels import conv3d",
                             "import only the packages below them"),
    "kernels-import-runtime": ("kernels/__init__.py",
                               "from cosmotrain.runtime import job_runtime",
                               "import only the packages below them"),
    "files-import-config": ("files/__init__.py", "from cosmotrain.config import schema",
                            "import only the packages below them"),
    "back-end-imports-front-door": ("kernels/cuda/layouts.py",
                                    "from cosmotrain.kernels import conv3d",
                                    "never import the front doors"),
    "outputs-import-the-run": ("train/outputs/__init__.py",
                               "from cosmotrain.train import trainer",
                               "never import the run around them"),
    "checkpoints-import-outputs": ("train/checkpoints/__init__.py",
                                   "from cosmotrain.train.outputs import metrics",
                                   "independent of each other"),
}


@pytest.mark.parametrize("plant", list(PLANTED))
def test_each_contract_catches_a_planted_violation(tmp_path: Path, plant: str) -> None:
    """A copy of the package with one forbidden import, inside a function (the graph
    counts those too), breaks the contract that forbids it (and may break others through
    what it imports indirectly)."""
    where, statement, contract = PLANTED[plant]
    shutil.copytree(PACKAGE, tmp_path / "cosmotrain",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = tmp_path / "cosmotrain" / where
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {statement}  # noqa\n")
    done = lint_imports(tmp_path)
    broken = [line for line in done.stdout.splitlines() if line.endswith("BROKEN")]
    assert done.returncode != 0 and any(contract in line for line in broken), done.stdout


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_no_folder_holds_more_than_15_modules() -> None:
    crowded = {str(folder.relative_to(REPO)): count for folder in [PACKAGE, *PACKAGE.rglob("*")]
               if folder.is_dir() and (count := len([p for p in folder.glob("*.py")
                                                      if p.name != "__init__.py"])) > MAX_MODULES}
    assert not crowded, f"give these folders rooms (over {MAX_MODULES} modules): {crowded}"


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
