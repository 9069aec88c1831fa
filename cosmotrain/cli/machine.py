"""Which machine model a command prices with, and the line saying so.

``plan`` and ``parallel: auto`` work out of the box: ``--machine`` / ``parallel.machine``
(a preset or a file) first, then the calibrated default file (``machine_file()``), and on
a machine never calibrated a quick estimate measured here once and cached beside that file
(:mod:`cosmotrain.study.estimate`).  Every command says which one it used.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cosmotrain.cli.app import machine_file, slurm_per_node
from cosmotrain.config.schema import Config
from cosmotrain.errors import UserError
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.planner import NodeLayout, node_layout
from cosmotrain.train.auto_layout import load_machine


def note(line: str) -> None:
    """Progress and provenance lines go to stderr, so ``--json`` output stays parseable."""
    print(line, file=sys.stderr, flush=True)


def command_machine(spec: str | None) -> tuple[MachineModel, str]:
    """The machine model for ``plan``: ``spec``, else the calibrated file, else the
    quick estimate (measured now if not cached); and the ``machine model: ...`` line."""
    from cosmotrain.study.estimate import cached_estimate, estimate_path

    default = machine_file()
    if spec or default.is_file():
        machine = load_machine(spec, default)
        where = f" ({spec or default})" if machine.source == "calibrated" else ""
    else:
        machine, where = cached_estimate(estimate_path(default), note)
        where = f"; {where}"
    return machine, f"machine model: {machine.describe()}{where}"


def auto_machine_path(cfg: Config, comm: Any) -> Path:
    """The machine file ``parallel: auto`` reads when ``parallel.machine`` is unset: the
    calibrated one, else the quick estimate, which rank 0 measures (or finds cached) while
    the other ranks sleep, so they leave its cores alone (collective)."""
    default = machine_file()
    if not cfg.parallel.auto or cfg.parallel.machine or default.is_file():
        return default
    from cosmotrain.comm.collective import on_root
    from cosmotrain.study.estimate import cached_estimate, estimate_path
    from cosmotrain.study.layer_timing import quiet_barrier

    path = estimate_path(default)
    where = cached_estimate(path, note)[1] if comm.Get_rank() == 0 else ""
    quiet_barrier(comm)
    where = on_root(comm, lambda: where)
    if where.startswith("not cached"):
        raise UserError(f"parallel: auto found no calibrated machine model at {default} and "
                        f"its quick estimate was {where}; make that directory writable, "
                        f"point COSMOTRAIN_MACHINE elsewhere, or set parallel.machine")
    return path



def target_nodes(ranks: int | None, ranks_per_node: int | None, comm: Any
                 ) -> NodeLayout | None:
    """The job ``train --dry-run --ranks N [--ranks-per-node K]`` checks (None: this job);
    per node as ``plan`` assumes: K, else the Slurm allocation's, else all on this node."""
    if ranks is None and ranks_per_node is None:
        return None
    return node_layout(ranks or comm.Get_size(), ranks_per_node, slurm_per_node())
