"""Training: optimizers (and, with the trainer issue, schedules, the loop, checkpoints)."""
