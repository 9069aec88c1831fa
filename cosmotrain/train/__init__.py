"""Training and inference runs: everything ``cosmotrain train`` and ``predict`` do around
the step (the step itself is :mod:`cosmotrain.engine`'s).

The run: ``run`` (``cosmotrain train`` and ``--dry-run``, from the claim of
``output.dir`` to the summary; ``dry_run`` holds the dry run's memory check and ``--ranks
N`` layouts), ``auto_layout`` (``parallel: auto``: the machine file and the collective
choice), ``job_setup`` (what a run builds before its first step), ``trainer`` (the loop),
``evaluate`` (validation), ``stops`` (stop signals from the first second, and non-finite
values), ``claim`` + ``run_outputs`` (output.dir: locked, and never mixed with another
run's outputs), ``predict`` and ``export`` (weights for PyTorch).  Two rooms:
``checkpoints/`` (write, verify, resume, compatibility) and ``outputs/`` (every output an
observer on one bus).  See docs/TRAINING.md.
"""
