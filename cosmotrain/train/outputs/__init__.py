"""What a run reports: every output an observer of the trainer's records.

``observers`` (the :class:`~cosmotrain.train.outputs.observers.Observer` protocol and the
bus the trainer emits each record to once), ``metrics`` (``metrics.jsonl``), ``progress``
(the console view on rank 0), ``tensorboard`` (TensorBoard event files), ``mlperf`` (the
MLPerf HPC compliance log of a run) and ``mlperf_writer`` (the ``mlperf.log`` file and its
one writer).  A new output format is one new module here.
"""
