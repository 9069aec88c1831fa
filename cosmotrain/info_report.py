"""Render the ``cosmotrain info`` report as Rich tables on rank 0."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table

from cosmotrain.console import make_console


def render_info(report: dict[str, Any]) -> None:
    """Print versions, MPI, the rank -> host layout and GPU status."""
    console = make_console()
    versions = Table(title="cosmotrain info", show_header=False)
    for name, version in report["versions"].items():
        versions.add_row(name, version)
    versions.add_row("MPI library", report["mpi_library"])
    versions.add_row("world size", str(report["world_size"]))
    versions.add_row("CPU convolutions", report["cpu_kernels"])
    versions.add_row("host allocator", report["host_allocator"])
    gpus = report["gpus"]
    versions.add_row("GPUs visible (rank 0)", "\n".join(gpus) if gpus else "none")
    for name, status in report["gpu_libraries"].items():
        versions.add_row(name, status)
    console.print(versions)
    console.print(_layout_table(report["ranks"]))


def _layout_table(records: list[dict[str, Any]]) -> Table:
    per_host = Counter(r["host"] for r in records)
    table = Table(title=f"rank layout ({len(records)} rank(s) on {len(per_host)} host(s))")
    for column in ("rank", "host", "pid", "GPUs", "CUDA_VISIBLE_DEVICES"):
        table.add_column(column)
    for r in records:
        table.add_row(str(r["rank"]), r["host"], str(r["pid"]), str(len(r["gpus"])),
                      r["cuda_visible_devices"] or "-")
    return table
