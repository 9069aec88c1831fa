"""The training step: what one step computes, used by ``train/``, ``study/`` and the benchmarks.

``step`` (:class:`~cosmotrain.engine.step.HybridStep`: forward, loss, backward, the
gradient reduction and the optimizer update on one rank's blocks, and the builders of a
job's step from a config), ``grad_sync`` (the gradient buckets and their reduction over
exactly the ranks that share a parameter), ``optim`` and ``optim_shards`` (SGD and Adam,
and their state sharded over the replicas, ``parallel.shard_optimizer``) and ``schedule``
(learning-rate schedules).  The run around the step (the loop, checkpoints, outputs) is
:mod:`cosmotrain.train`'s.
"""
