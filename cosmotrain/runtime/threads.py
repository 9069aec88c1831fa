"""Share a node's cores among the ranks placed on it: BLAS threads per rank.

Several ranks on one node that each run OpenBLAS with a thread per core oversubscribe it,
and OpenBLAS's idle threads spin: 2 ranks on 2 cores (cosmoflow W=128, D2) took 0.884 s a
step with 2 BLAS threads each against 0.639 s with 1 (``bench_hybrid.py --threads``).
Each rank therefore gets ``cores / local ranks`` threads (at least one), unless the
launcher already bound it to fewer cores than the node has (``srun --cpus-per-task``),
in which case its own affinity mask is the budget.  An explicit ``OPENBLAS_NUM_THREADS``
or ``OMP_NUM_THREADS`` (the Slurm scripts set them from ``--cpus-per-task``) caps it.  The
chunked kernels use as many workers as BLAS has threads (``kernels/cpu/workers.py``).

:func:`job_threads` decides (collective, no side effect): the job records the value in
its :class:`~cosmotrain.runtime.job_runtime.Runtime` (``build_runtime(..., threads=)``), which
applies it once through :func:`cosmotrain.kernels.cpu.workers.configure_threads`.
"""

from __future__ import annotations

import os
from typing import Any

from cosmotrain.kernels.cpu.workers import KernelThreads


def threads_per_rank(local_ranks: int, usable_cores: int, node_cores: int) -> int:
    """Threads for one rank: its bound cores, or an equal share of an unbound node."""
    if local_ranks < 1 or usable_cores < 1 or node_cores < 1:
        raise ValueError("threads_per_rank needs positive counts, got "
                         f"{local_ranks}, {usable_cores}, {node_cores}")
    if usable_cores < node_cores:  # the launcher bound this rank
        return usable_cores
    return max(1, node_cores // local_ranks)


def job_threads(comm: Any) -> KernelThreads:
    """This rank's kernel threads from the ranks sharing its node and the thread
    variables (collective over ``comm``; sets nothing)."""
    from cosmotrain.comm import node_ranks

    local_ranks = node_ranks(comm)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    threads = threads_per_rank(local_ranks, usable, os.cpu_count() or usable)
    limit = env_thread_limit()
    if limit is not None:
        threads = min(threads, limit)
    return KernelThreads(threads)


def env_thread_limit(env: Any = None) -> int | None:
    """The thread count the user set (OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS), if any."""
    env = os.environ if env is None else env
    for key in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = env.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None
