"""What ``train --dry-run`` checks beyond the config: will one step fit in memory?

The need is the planner's memory model (:func:`cosmotrain.plan.memory.rank_memory`: the
busiest rank's saved activations and largest backward gradients, its parameters with
their gradients and optimizer state, its input block; float32, as ``cosmotrain plan``
prices it).  What a rank has is its device's share: on the CPU this node's
``MemAvailable`` shared by the ranks per node, on a GPU the device's free memory shared by
the ranks bound to it, each less the planner's reserve for the runtime, MPI and
workspaces (``MEMORY_RESERVE``).  A step that does not fit is a user error (exit 2) naming
the layout, the need, what is there and how to fix it, before any data is read.

``--ranks N`` (and ``--ranks-per-node K``) check a layout for a job of another size
without launching it (:func:`layout_plan`): the same model and the same check, for this
node's memory, with no process grid or distributed model built.
"""

from __future__ import annotations

from typing import Any

from cosmotrain.config.layout import Layout, resolve_parallel
from cosmotrain.config.schema import Config
from cosmotrain.data.readers.preload_memory import mem_available
from cosmotrain.device.select import Device
from cosmotrain.errors import UserError
from cosmotrain.plan.memory import RankMemory, rank_memory
from cosmotrain.plan.planner import MEMORY_RESERVE, NodeLayout
from cosmotrain.plan.workload import build_workload

FIXES = ("use more ranks (more sample groups share the batch), a finer spatial split "
         "(parallel.depth / height / width), or a smaller train.batch_size")


def layout_plan(cfg: Config, nodes: NodeLayout, device: Device) -> list[str]:
    """The dry run of ``cfg`` on ``nodes.ranks`` ranks, from the model alone: the layout,
    the first layer on whole samples and the memory check (raises when it does not fit)."""
    layout = resolve_parallel(cfg, nodes.ranks)
    return [f"layout: {layout.describe()} on {nodes.ranks} rank(s) = {nodes.describe()} "
            f"({nodes.why}; checked from the model, not launched); model {cfg.model.name} "
            f"at W={cfg.model.width}, batch {cfg.train.batch_size}",
            f"first layer on whole samples: {_workload(cfg, layout).stop or '(none)'}",
            *memory_check(cfg, layout, nodes, device)]


def memory_check(cfg: Config, layout: Layout, nodes: NodeLayout, device: Device
                 ) -> list[str]:
    """The memory lines of the dry run; a :class:`UserError` when a step does not fit in
    what a rank of ``nodes`` has on ``device`` (rank 0's node stands for every node)."""
    need = rank_memory(_workload(cfg, layout))
    available, sharers, where = _available(device, nodes)
    need_line = (f"memory per rank (planner's model, float32): activations "
                 f"{_size(need.activations)} + parameters, gradients and optimizer state "
                 f"{_size(need.state)} + input block {_size(need.inputs)} = "
                 f"{_size(need.total)}")
    if available is None:
        return [need_line, f"available memory: unknown on this platform ({where}): not checked"]
    budget = available * (1 - MEMORY_RESERVE) / sharers
    share = (f"{_size(available)} {where}, less {MEMORY_RESERVE:.0%} for the runtime, "
             f"shared by {sharers} rank(s): {_size(budget)} per rank")
    if need.total > budget:
        raise UserError(refusal(layout, nodes, need, share))
    return [need_line, f"available: {share}; fits"]


def refusal(layout: Layout, nodes: NodeLayout, need: RankMemory, share: str) -> str:
    """The one-line error of a step that does not fit: layout, need, what is there, fixes."""
    return (f"--dry-run: layout {layout.describe()} on {nodes.ranks} rank(s) "
            f"({nodes.describe()}) needs {_size(need.total)} per rank (activations "
            f"{_size(need.activations)}, parameters with gradients and optimizer state "
            f"{_size(need.state)}, input block {_size(need.inputs)}) but has {share}; "
            f"{FIXES} (--ranks N [--ranks-per-node K] checks another job size)")


def _available(device: Device, nodes: NodeLayout) -> tuple[int | None, int, str]:
    """Bytes there, how many ranks share them, and where they are."""
    if device.is_gpu:
        free, _ = device.xp.cuda.runtime.memGetInfo()
        return int(free), max(device.shared_by, 1), f"free on GPU {device.index}"
    return mem_available(), nodes.per_node, "MemAvailable on this node"


def _workload(cfg: Config, layout: Layout) -> Any:
    """The planner's workload of ``layout``; a split the engine refuses is a user error."""
    try:
        return build_workload(cfg, layout)
    except ValueError as err:
        raise UserError(f"--dry-run: the engine cannot run {layout.describe()} for this "
                        f"model ({err}); change the parallel section") from None


def _size(nbytes: float) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
