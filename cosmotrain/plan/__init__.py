"""Planning, pure: what a strategy costs before anything runs.

Owns the strategies (``strategy``), the busiest rank's workload of one step
(``workload``), FLOP and memory arithmetic (``flops``, ``memory``), the cost model
(``cost``), machine models, their presets and the quick estimate's model of an
uncalibrated machine (``machine``, ``presets``, ``estimate``), the planner that
ranks strategies and picks one for ``parallel: auto`` (``planner``) and the ``cosmotrain
plan`` tables and files (``report``).

May import: ``data``, ``layers``, ``models``, ``nn``, ``tensor``, ``comm``, ``device``,
``kernels``, ``config`` and the top-level helpers (``errors``, ``atomic``); never
``train``, ``study`` or ``cli`` (``train`` imports this package for ``parallel: auto``).
No MPI at import or in its functions, except ``planner.choose_parallel``, which is handed
the job's communicator.  ``study`` measures what this package predicts.
"""
