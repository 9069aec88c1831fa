"""Configuration: typed schema, YAML loading, ``--set`` overrides and validation.

``schema`` (the typed sections), ``load`` (YAML, ``--set``, the resolved ``config.yaml``),
``layout`` (the one :class:`Layout` value: the ranks over N, C, F, D, H, W, the spatial
stop and the channel algorithm; strategy names; its validation), ``device`` (the
``device`` rules that need no probe of the machine) and ``reference`` (the generated
config reference).
"""

from cosmotrain.config.layout import Layout, resolve_parallel
from cosmotrain.config.load import config_to_dict, dump_yaml, load_config, save_resolved
from cosmotrain.config.schema import Config

__all__ = ["Config", "Layout", "config_to_dict", "dump_yaml", "load_config",
           "resolve_parallel", "save_resolved"]
