"""The per-job runtime, built once and passed down: it sits above ``comm/`` and ``kernels/``.

``job_runtime`` (the frozen :class:`~cosmotrain.runtime.job_runtime.Runtime`: the device,
the transport every message goes through, the phase timers, the GPU convolution settings
and the kernel threads; ``build_runtime``), ``threads`` (the BLAS threads and kernel
workers per rank, decided collectively) and ``timers`` (the phase timers of a step's time
breakdown).
"""
