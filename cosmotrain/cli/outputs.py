"""Commands that read a finished run's outputs: report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.cli.app import app


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(
        metavar="RUN_DIR", help="A training run's output.dir (the one holding "
                                "metrics.jsonl).")],
    out: Annotated[Optional[Path], typer.Option(
        help="Directory for the PNGs (default: RUN_DIR/plots).")] = None,
) -> None:
    """Plot a run's training loss, validation MAE, throughput and time breakdown (PNGs)."""
    from cosmotrain.study.run_plots import MAE_PNG, write_run_plots

    written = write_run_plots(run_dir, out)
    print(f"wrote {len(written)} plot(s) to {written[0].parent}: "
          f"{', '.join(path.name for path in written)}")
    if all(path.name != MAE_PNG for path in written):
        print(f"no {MAE_PNG}: {run_dir}/metrics.jsonl has no validation record (one is "
              f"written after every train.validate_every epochs, given a validation split)")
