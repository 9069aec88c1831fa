"""How ``cosmotrain plan`` shows its ranking: a Rich table, JSON, or an applied config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cosmotrain.files.atomic import write_atomically
from cosmotrain.config.load import config_to_dict
from cosmotrain.config.schema import Config
from cosmotrain.plan.cost import PHASES
from cosmotrain.plan.machine import MachineModel
from cosmotrain.plan.planner import NodeLayout, Planned


def plan_table(planned: list[Planned], cfg: Config, nodes: NodeLayout, machine: MachineModel
               ) -> None:
    """The ranking: predicted step, samples/s, memory per rank, communication share; the
    title says how the ranks sit on nodes (``nodes x ranks per node``) and why."""
    table = Table(title=f"{cfg.model.name} W={cfg.model.width} batch {cfg.train.batch_size} "
                        f"on {nodes.ranks} rank(s) = {nodes.describe()} ({nodes.why}), "
                        f"machine {machine.name}")
    for column in ("#", "strategy", "step ms", "samples/s", "GiB/rank", "comm", "stop",
                   "top comm"):
        table.add_column(column, justify="left" if column in ("strategy", "stop") else "right")
    for index, item in enumerate(planned, start=1):
        p = item.prediction
        phases = {k: v for k, v in p.seconds.items() if k != "compute"}
        worst = max(phases, key=lambda k: phases[k])
        table.add_row(str(index), p.strategy.describe(), f"{p.step_s * 1e3:.1f}",
                      f"{p.samples_per_s:.2f}", f"{item.memory_bytes / 2**30:.2f}",
                      f"{p.comm_share:.0%}", item.stop or "-",
                      f"{worst} {phases[worst] * 1e3:.1f} ms")
    Console().print(table)


def plan_json(planned: list[Planned], machine: MachineModel, nodes: NodeLayout
              ) -> dict[str, Any]:
    """The ranking as data (``--json``), with the node layout and the machine model's
    source (calibrated, preset or estimate) it was priced on."""
    return {"machine": machine.name, "machine_source": machine.source,
            "machine_model": machine.describe(), "ranks": nodes.ranks, "nodes": nodes.nodes,
            "ranks_per_node": nodes.per_node, "ranks_per_node_from": nodes.why, "strategies": [
        {"strategy": item.strategy.describe(), "parallel": item.strategy.parallel_section(),
         "step_s": item.prediction.step_s, "samples_per_s": item.prediction.samples_per_s,
         "memory_bytes": item.memory_bytes, "comm_share": item.prediction.comm_share,
         "stop": item.stop,
         "seconds": {k: item.prediction.seconds[k] for k in PHASES}} for item in planned]}


def write_applied(cfg: Config, strategy: Any, path: Path) -> Path:
    """``cfg`` with ``strategy``'s parallel section, as YAML, written atomically."""
    import yaml

    data = config_to_dict(cfg)
    kept = {k: v for k, v in data["parallel"].items()
            if k in ("bn_statistics", "bucket_mb", "shard_optimizer")}
    data["parallel"] = {**strategy.parallel_section(), **kept}
    text = yaml.safe_dump(data, sort_keys=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, lambda tmp: tmp.write_text(text))
