"""The Typer application and what its commands share: options and the user's settings.

The environment is read here, at the command line's edge, and passed down as values: the
machine file of the performance model, and the per-user cache directory of dataset tables.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from cosmotrain.config.schema import Config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Hybrid-parallel training of 3D CNNs (CosmoFlow, 3D ResNet) on large volumes.",
)

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


def with_user_defaults(cfg: Config) -> Config:
    """``cfg`` with the settings the environment supplies where the config left them null
    (``data.cache_dir``), so nothing below the command line reads the environment."""
    if cfg.data.cache_dir is None:
        cfg.data.cache_dir = user_cache_dir()
    return cfg


def machine_file() -> Path:
    """``$COSMOTRAIN_MACHINE``, else ``$XDG_CACHE_HOME`` (or ~/.cache)/cosmotrain/machine.json."""
    return Path(os.environ.get("COSMOTRAIN_MACHINE") or _user_cache() / "cosmotrain" /
                "machine.json")
