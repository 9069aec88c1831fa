"""The mutation check of the core: a reviewed catalogue of plausible one-line bugs, each
applied to a copy of the repository and run against the tests that cover its module.

Run it with ``python -m mutation`` from the repository root (docs/TESTING.md).  It is not
part of ``pytest``: it runs the covering tests once per mutant, about 30 minutes.
"""
