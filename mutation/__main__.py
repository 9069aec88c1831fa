"""``python -m mutation``: run the mutation check of the core (docs/TESTING.md).

Exit status 0 when the kill rate reaches ``--min-rate`` (0.95), 1 when it does not, 2
when the catalogue does not apply to the tree (a stale snippet, a missing test file) or
the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from mutation.catalogue import CATALOGUE, load_catalogue, problems
from mutation.runner import Outcome, run_all

ROOT = Path(__file__).resolve().parents[1]


def _interrupt(number: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: kill the tests, restore, remove the copy


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(prog="python -m mutation", description=__doc__)
    parser.add_argument("--catalogue", type=Path, default=CATALOGUE)
    parser.add_argument("--only", default="",
                        help="run only the mutants whose file path or id contains this")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="the most seconds one mutant's tests may run (a timeout is a "
                        "kill); with the baseline, 8x the unmutated tests' time, >= 30 s")
    parser.add_argument("--jobs", "-j", type=int, default=1,
                        help="mutants run at once, each in its own copy (default 1)")
    parser.add_argument("--min-rate", type=float, default=0.95)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the unmutated tests (they must pass)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--json", type=Path, help="also write every outcome to this file")
    args = parser.parse_args(argv)

    mutants = [m for m in load_catalogue(args.catalogue) if args.only in m.ident]
    found = problems(mutants, ROOT)
    if found:
        print("the catalogue does not apply to this tree:\n  " + "\n  ".join(found))
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.ident}: {m.bug}  [{' '.join(m.tests)}]")
        return 0
    print(f"{len(mutants)} mutants, {args.jobs} at a time, timeout {args.timeout:.0f} s")
    start = time.perf_counter()
    try:
        failures, outcomes = run_all(ROOT, mutants, args.timeout, args.jobs, _print,
                                     check_baseline=not args.no_baseline)
    except KeyboardInterrupt:
        print("interrupted: the tests were stopped and the copy removed")
        return 130
    for failure in failures:
        print(f"{failure.verdict}\n{failure.tail}")
    if failures:
        return 2
    return _summary(outcomes, time.perf_counter() - start, args)


def _print(outcome: Outcome) -> None:
    assert outcome.mutant is not None
    print(f"{outcome.verdict:9s} {outcome.seconds:6.1f} s  {outcome.mutant.ident}: "
          f"{outcome.mutant.bug}", flush=True)


def _summary(outcomes: list[Outcome], seconds: float, args: argparse.Namespace) -> int:
    killed = sum(o.killed for o in outcomes)
    rate = killed / len(outcomes) if outcomes else 1.0
    survivors = [o for o in outcomes if not o.killed]
    print(f"\n{killed} of {len(outcomes)} mutants killed ({rate:.1%}) in "
          f"{seconds / 60:.1f} minutes; {len(survivors)} survived")
    for o in survivors:
        assert o.mutant is not None
        print(f"  survived {o.mutant.ident}: {o.mutant.bug}\n"
              f"    - {o.mutant.original.strip()}\n    + {o.mutant.mutated.strip()}")
    if args.json:
        args.json.write_text(json.dumps(
            [{"id": o.mutant.ident, "bug": o.mutant.bug, "verdict": o.verdict,
              "seconds": round(o.seconds, 1)} for o in outcomes if o.mutant], indent=1))
    return 0 if rate >= args.min_rate else 1


if __name__ == "__main__":
    sys.exit(main())
