"""The ``cosmotrain`` command line (Typer).

Thin by design: parse arguments, load the config, call the library, and map errors to exit
codes.  A :class:`~cosmotrain.errors.UserError` prints one line and exits 2 with no
traceback; any other exception prints its traceback and aborts the whole MPI job, so a
failure on one rank never leaves the others hanging.
"""

from __future__ import annotations

import sys
import traceback

from cosmotrain.cli import run, data, outputs, export, study  # the order in --help
from cosmotrain.cli.app import app
from cosmotrain.errors import JobStopped, UserError
from cosmotrain.exits import EXIT_KEYBOARD, exit_code, report_stop, report_user_error

__all__ = ["app", "main", "report_user_error"]

# Importing a command module registers its commands on ``app``, in this order in --help.
COMMAND_MODULES = (run, data, outputs, export, study)


def main() -> None:
    """Console-script entry point with the error-to-exit-code mapping."""
    from cosmotrain.comm import abort_job

    try:
        app()
    except UserError as err:
        report_user_error(err)
        sys.exit(exit_code(err))
    except JobStopped as err:  # a stop signal during start-up, or a second Ctrl-C
        report_stop(err)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint, but no rank left behind
        print("cosmotrain: interrupted again: stopping at once (no checkpoint)",
              file=sys.stderr, flush=True)
        abort_job(EXIT_KEYBOARD)
        sys.exit(EXIT_KEYBOARD)
    except Exception:  # noqa: BLE001 - a bug: show it, and never leave other ranks hanging
        traceback.print_exc()
        sys.stderr.flush()
        abort_job(1)
        sys.exit(1)
