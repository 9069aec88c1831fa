"""The Typer application and what its commands share: options and the user's settings.

The environment is read here, at the command line's edge, and passed down as values: the
machine file of the performance model, and the per-user cache directory of dataset tables.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain import logs
from cosmotrain.cli.help_flags import show_flags_bare
from cosmotrain.config.schema import Config
from cosmotrain.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Hybrid-parallel training of 3D CNNs (CosmoFlow, 3D ResNet) on large volumes.",
)
show_flags_bare()  # --help: `--resume`, not `--resume <bool>`


@app.callback()
def global_options(
    log_level: Annotated[str, typer.Option(
        "--log-level", metavar="LEVEL", help="Log lines on stderr from this level: debug, "
        "info, warning (the default) or error; ranks other than 0 show warnings and "
        "errors only.")] = "warning",
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Debug log lines from every rank, each tagged with its "
        "rank and host.")] = False,
) -> None:
    """Options for every command, given before it: cosmotrain -v train ..."""
    try:
        level = logs.parse_level(log_level)
    except ValueError as err:
        raise UserError(f"--log-level: {err}") from None
    logs.setup_logging(logs.LEVELS["debug"] if verbose else level, every_rank=verbose)

ConfigOption = Annotated[Optional[Path], typer.Option(
    "--config", "-c", help="YAML config file (see configs/).")]
SetOption = Annotated[Optional[list[str]], typer.Option(
    "--set", "-s", help="Override a config key: --set train.batch_size=8 (repeatable).")]


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


CACHE_ENV = "COSMOTRAIN_CACHE_DIR"


def user_cache_dir() -> str:
    """The default of ``data.cache_dir``: ``$COSMOTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME``
    (or ~/.cache)/cosmotrain."""
    return os.environ.get(CACHE_ENV) or str(_user_cache() / "cosmotrain")


def load_user_config(path: Optional[Path], overrides: Optional[list[str]]) -> Config:
    """The config of ``--config`` and ``--set``, ``${VAR}`` in its path keys expanded from
    this process's environment (library callers of ``load_config`` pass their own)."""
    from cosmotrain.config import load_config

    return load_config(path, overrides or [], env=os.environ)


def with_user_defaults(cfg: Config) -> Config:
    """``cfg`` with the settings the environment supplies where the config left them null
    (``data.cache_dir``), so nothing below the command line reads the environment."""
    if cfg.data.cache_dir is None:
        cfg.data.cache_dir = user_cache_dir()
    return cfg


def slurm_per_node() -> int | None:
    """Tasks per node of the Slurm allocation this command runs in (None outside one):
    the default ranks per node of ``plan`` and ``train --dry-run --ranks``."""
    from cosmotrain.study.launch import slurm_tasks_per_node

    if not os.environ.get("SLURM_JOB_ID"):
        return None
    return slurm_tasks_per_node(dict(os.environ))


def machine_file() -> Path:
    """``$COSMOTRAIN_MACHINE``, else ``$XDG_CACHE_HOME`` (or ~/.cache)/cosmotrain/machine.json."""
    return Path(os.environ.get("COSMOTRAIN_MACHINE") or _user_cache() / "cosmotrain" /
                "machine.json")
