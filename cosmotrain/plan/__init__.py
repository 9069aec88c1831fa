"""Planning, pure: what a strategy costs before anything runs.

Owns the strategies (``strategy``), the busiest rank's workload of one step
(``workload``), FLOP and memory arithmetic (``flops``, ``memory``), the cost model
(``cost``), machine models, their presets and the quick estimate's model of an
uncalibrated machine (``machine``, ``presets``, ``estimate``), the planner that
ranks strategies and picks one for ``parallel: auto`` (``planner``) and the ``cosmotrain
plan`` tables and files (``report``).

May import: ``data``, ``layers``, ``models``, ``nn``, ``tensor``, ``comm``, ``device``,
``kernels``, ``config``, ``files`` and ``errors``; never ``train``, ``study`` or ``cli``
(``train`` imports this package for ``parallel: auto``).  No MPI, and the planner takes
values: ``parallel: auto``'s collective and the search for the machine file are
``train/auto_layout.py``'s.  The only file forms here are a machine model's own JSON
(``MachineModel.load`` / ``save``) and ``cosmotrain plan --out`` (``report``).
``study`` measures what this package predicts.
"""
