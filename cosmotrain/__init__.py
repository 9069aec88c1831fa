"""cosmotrain: hybrid-parallel training of 3D CNNs on large scientific volumes."""

import os as _os

__version__ = "0.1.0"

# OpenBLAS's idle threads spin for 2**OPENBLAS_THREAD_TIMEOUT cycles after each threaded
# BLAS call before they sleep (default 2**28: about 0.1 s).  The CPU kernels run most of
# their GEMMs on their own worker threads with BLAS at one thread (kernels/cpu/workers.py),
# but small layers and the dense layers call threaded BLAS in between; its threads then
# spin on the cores the workers need for the next 0.1 s.  Measured on the 2-core box
# (cosmoflow W=128 batch 1, 2026-11-24): the data gradient of conv3 took 46-58 ms in a
# step against 30 ms alone, and the whole step 0.762 -> 0.677 s with 2**4.  OpenBLAS reads
# the variable once, when numpy loads it, so it is set here, before any numpy import
# under cosmotrain; a value the user set is kept.  docs/PERFORMANCE.md, "Idle BLAS spin".
BLAS_THREAD_TIMEOUT = "4"
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
