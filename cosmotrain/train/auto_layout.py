"""``parallel: auto`` at start-up: read the machine model, plan on rank 0, share the choice.

The planner (:mod:`cosmotrain.plan.planner`) is pure: it takes a config, a rank count and
a machine model and returns priced strategies.  What a job adds lives here: finding and
reading the machine file (:func:`load_machine`, also the CLI's and the scale study's) and
the collective that gives every rank the same choice, or the same error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosmotrain.comm import node_ranks
from cosmotrain.comm.collective import on_root
from cosmotrain.config.layout import Layout
from cosmotrain.config.schema import Config
from cosmotrain.errors import UserError
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.planner import auto_config, auto_line, plan
from cosmotrain.plan.presets import PRESETS


def load_machine(spec: str | None = None, default: Path | None = None) -> MachineModel:
    """A machine by preset name (``h100``...), by file, or the calibrated ``default`` file
    (the CLI's: ``$COSMOTRAIN_MACHINE``, else ``$XDG_CACHE_HOME/cosmotrain/machine.json``)."""
    if spec in PRESETS:
        return PRESETS[spec]()
    path = Path(spec) if spec else default
    if path is None or (not spec and not path.is_file()):
        raise UserError(f"no machine model at {path or '(no default path given)'}: run "
                        f"`cosmotrain calibrate` on this machine first, or pass --machine "
                        f"FILE or a preset ({', '.join(PRESETS)})")
    return MachineModel.load(path)


def choose_parallel(cfg: Config, comm: Any, machine_path: Path | None = None,
                    ranks: int | None = None, ranks_per_node: int | None = None
                    ) -> tuple[Config, str]:
    """``cfg`` with the planner's best strategy for this job when ``parallel.auto``.

    Collective: rank 0 plans (the machine file need only be readable there) and every
    rank gets the same choice, or the same error.  Returns the config (``auto`` cleared,
    so the saved config and checkpoints record the layout that ran) and a line to print,
    which says which machine model priced it.  ``machine_path`` is the machine file used
    when ``parallel.machine`` is unset (the CLI's calibrated file, or its quick estimate).
    ``ranks`` / ``ranks_per_node`` plan for another job than ``comm`` (``--dry-run
    --ranks N``; default per node: all ``ranks`` on one).
    """
    if not cfg.parallel.auto:
        return cfg, ""
    size = ranks or comm.Get_size()
    per_node = ranks_per_node or (size if ranks else node_ranks(comm))

    def best() -> tuple[Layout, float, str]:
        machine = load_machine(cfg.parallel.machine, machine_path)
        top = plan(cfg, size, machine, min(per_node, size))[0]
        return top.strategy, top.prediction.step_s, machine.describe()

    strategy, step_s, machine = on_root(comm, best)
    return auto_config(cfg, strategy), auto_line(strategy, size, per_node, step_s, machine)
