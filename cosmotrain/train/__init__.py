"""Training and inference runs: everything ``cosmotrain train`` and ``predict`` do.

Owns the run (``runner``: ``cosmotrain train`` and ``--dry-run``, whose memory check and
``--ranks N`` layouts are ``dry_run``'s; ``job``: what a run sets
up before its first step), the step and the loop (``step``, ``grad_sync``, ``trainer``,
``guard``, ``evaluate``), optimizers and learning-rate schedules (``optim``,
``schedule``), checkpoints and resuming (``snapshot``, ``checkpoint``, ``resume``,
``resume_check``), the output directory (``claim``, ``rundir``, ``run_outputs``),
``metrics.jsonl`` and the console view (``metrics``, ``progress``), and ``cosmotrain
predict`` (``predict``).  See docs/TRAINING.md.
"""
