"""Configuration: typed schema, YAML loading, ``--set`` overrides and validation."""

from cosmotrain.config.load import config_to_dict, dump_yaml, load_config, save_resolved
from cosmotrain.config.parallel import ParallelLayout, resolve_parallel
from cosmotrain.config.schema import Config

__all__ = ["Config", "ParallelLayout", "config_to_dict", "dump_yaml", "load_config",
           "resolve_parallel", "save_resolved"]
