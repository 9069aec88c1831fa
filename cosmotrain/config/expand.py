"""``${VAR}`` in the path keys of a config: ``output.dir: ${SCRATCH}/runs/a``.

A config shared by a team, or kept in a repository, cannot name anyone's scratch
directory; an environment variable can.  Only the path-valued keys (:data:`PATH_KEYS`) are
expanded, only the ``${NAME}`` form (a bare ``$`` is kept as it is), and ``$$`` writes
one ``$``.  A variable that is not set is a :class:`ConfigError` naming the key and the
variable: silently expanding it to nothing would point ``output.dir`` at ``/runs/a``.

The environment is handed in by the caller (the command line passes its own);
a library call that passes none expands nothing, so a config means the same whatever
the process environment (docs/ARCHITECTURE.md, "Who reads the environment").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from cosmotrain.errors import ConfigError

#: The path-valued keys: expanded here, compared normalised on resume (``resume_check``).
PATH_KEYS = frozenset({"data.path", "data.stage_dir", "data.cache_dir", "output.dir"})

_TOKEN = re.compile(r"\$\$|\$\{([^}]*)\}|\$\{")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_path_keys(raw: dict[str, Any], env: Mapping[str, str] | None) -> None:
    """Expand ``${VAR}`` and ``$$`` in the string values of :data:`PATH_KEYS` of ``raw``
    (a parsed config, changed in place); nothing when ``env`` is None."""
    if env is None:
        return
    for key in sorted(PATH_KEYS):
        section, _, name = key.partition(".")
        values = raw.get(section)
        if isinstance(values, dict) and isinstance(values.get(name), str):
            values[name] = expand(key, values[name], env)


def expand(key: str, text: str, env: Mapping[str, str]) -> str:
    """``text`` with each ``${NAME}`` replaced by ``env[NAME]`` and each ``$$`` by ``$``."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        if name is None or not _NAME.fullmatch(name):
            raise ConfigError(key, f"{text!r} has a malformed variable "
                              f"{match.group(0)!r}", "write ${NAME} (letters, digits, _), "
                              "or $$ for a literal $")
        if name not in env:
            raise ConfigError(key, f"{text!r} uses ${{{name}}}, which is not set in the "
                              f"environment", f"export {name}=... or write the path out")
        return env[name]

    return _TOKEN.sub(substitute, text)
