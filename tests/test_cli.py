"""The command line: exit codes, one-line errors without tracebacks, `info`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, mpiexec, subprocess_env


def test_config_prints_the_resolved_config(cli) -> None:
    code, out, _ = cli("config", "-c", str(REPO / "configs/tiny.yaml"),
                       "--set", "train.batch_size=8", "--ranks", "2")
    assert code == 0
    body = yaml.safe_load(out)
    assert body["train"]["batch_size"] == 8 and body["model"]["name"] == "tiny"
    assert "strategy N2 on 2 rank(s)" in out


@pytest.mark.parametrize("args, fragment", [
    (["config", "--set", "train.bach_size=3"], "did you mean 'train.batch_size'"),
    (["config", "-c", "no/such.yaml"], "not found"),
    (["config", "--set", "parallel.depth=2", "--ranks", "3"], "parallel"),
    (["datagen", "--out", "unused", "--samples", "0"], "--samples"),
])
def test_user_errors_exit_2_with_one_line(cli, args: list[str], fragment: str) -> None:
    code, _, err = cli(*args)
    assert code == 2
    assert fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_bad_argument_exits_2(cli) -> None:
    code, _, err = cli("datagen", "--out", "x", "--layout", "sideways")
    assert code == 2 and "sideways" in err


def test_config_reference_lists_every_key(cli) -> None:
    code, out, _ = cli("config", "--reference")
    assert code == 0 and "`parallel.sample`" in out and "`output.dir`" in out


def test_info_json_one_rank(cli) -> None:
    code, out, _ = cli("info", "--json")
    report = json.loads(out)
    assert code == 0 and report["world_size"] == 1
    assert set(report["versions"]) >= {"cosmotrain", "python", "numpy", "mpi4py", "h5py"}
    assert "MPI" in report["mpi_library"] or "mpi" in report["mpi_library"].lower()
    assert "GEMM lowerings" in report["cpu_kernels"]
    assert report["host_allocator"].startswith(("planned step memory", "glibc heap"))
    assert "cuda wheels" in report["gpu_libraries"]


def test_info_names_the_cuda_route() -> None:
    from cosmotrain.info import cuda_route

    assert cuda_route({}) == "none"
    assert cuda_route({"cupy-cuda13x": "14.2.0", "nvidia-cudnn-cu13": "9.19.0"}) == \
        "CUDA 13 (extra gpu-cuda13): cupy-cuda13x 14.2.0, nvidia-cudnn-cu13 9.19.0"
    assert cuda_route({"cupy-cuda12x": "14.0.1", "nvidia-cudnn-cu12": "9.1"}).startswith(
        "CUDA 12 (extra gpu)")
    assert cuda_route({"cupy-cuda13x": "14.2.0"}).startswith(
        "CUDA 13, cupy without cuDNN (cupy-cuda13x 14.2.0): enough for the NVRTC checks")
    assert cuda_route({"cupy": "14.0.0"}) == "site install (cupy 14.0.0)"
    mixed = cuda_route({"cupy-cuda12x": "14.0.1", "nvidia-cudnn-cu13": "9.19.0"})
    assert mixed.startswith("mixed CUDA 12 and 13 wheels") and "gpu-cuda13" in mixed


def test_info_under_two_ranks() -> None:
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "cosmotrain", "info", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["world_size"] == 2
    assert [r["rank"] for r in report["ranks"]] == [0, 1]


def test_python_dash_m_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "cosmotrain", "--help"], capture_output=True,
                         text=True, timeout=60, env=subprocess_env())
    assert out.returncode == 0 and "datagen" in out.stdout and "info" in out.stdout


def test_rich_info_table(cli) -> None:
    code, out, _ = cli("info")
    assert code == 0 and "world size" in out and "rank layout" in out


def test_readme_config_reference_is_in_sync() -> None:
    from cosmotrain.config.reference import reference_markdown

    readme = (REPO / "README.md").read_text()
    start = readme.index("<!-- config-reference:start -->\n") + len(
        "<!-- config-reference:start -->\n")
    end = readme.index("<!-- config-reference:end -->")
    assert readme[start:end].strip() == reference_markdown().strip(), (
        "regenerate the README table from `cosmotrain config --reference`")
