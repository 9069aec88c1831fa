"""``--help`` shows a boolean flag as a flag: ``--resume``, not ``--resume <bool>``.

Typer's Rich help (0.2x, which formats options itself) prints every option's value type,
flags included, so ``--resume``, ``--json`` and ``--help`` itself read ``<bool>`` although
they refuse a value (``--resume true`` is an error); its plain help, like Click's, leaves
flags bare.  :func:`show_flags_bare` makes the Rich help agree, for every command at once.
Typer versions whose help has no ``display_type_rich`` (older ones print no type for
flags) are left alone.
"""

from __future__ import annotations

from typing import Any

import typer.core

_PATCHED = "_cosmotrain_flags_bare"


def show_flags_bare() -> None:
    """Make the Rich help show no value type for flags and counters (idempotent)."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if option is None or shown is None or getattr(shown, _PATCHED, False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None  # takes no value: nothing to show
        return shown(self, ctx)

    setattr(display_type_rich, _PATCHED, True)
    option.display_type_rich = display_type_rich
