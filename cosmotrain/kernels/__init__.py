"""Local compute kernels: the per-device operations that the distributed layers call.

A kernel works on one rank's local block and knows nothing about MPI, halos or the
process grid.  The package has front doors and back ends.

Front doors (this folder), one operation each, named the same on every device:
:mod:`.conv3d` (forward, data and filter gradients), :mod:`.pool3d` (average and max
pooling), :mod:`.activation`, :mod:`.batchnorm`, :mod:`.dropout`, :mod:`.linear`,
:mod:`.loss`, :mod:`.optim_update` and :mod:`.pool_activation` (a LeakyReLU's backward
inside the next average pooling's).  Each handles the empty batch (``N = 0``: a sample
group left empty by a short batch still runs its layers for their collectives, and gets
empty results and zero weight gradients), then asks :func:`.route.route` once where the
call runs, and hands it to one back end:

* :mod:`.cpu`: numpy (float32 in training, float64 in tests), chunked over the kernel
  worker pool (:mod:`.cpu.workers`);
* :mod:`.compiled`: the optional C loops (``compiled/native/*.c``) and their Python
  faces, for float32 where they pay, each with a numpy twin in :mod:`.cpu`;
* :mod:`.cuda`: cupy arrays: cuDNN frontend graphs or im2col + cuBLAS for convolutions,
  cupy element-wise kernels, and our own CUDA sources (``cuda/src/*.cu``).

bfloat16 storage on the CPU is widened to float32, computed, and rounded back
(:mod:`cosmotrain.precision`).  Shared conventions (:mod:`.geometry`,
:mod:`.pool_geometry`): NCDHW C-contiguous arrays; ``stride`` and ``kernel`` triples (or
ints); ``padding`` one ``(lo, hi)`` pair of zeros per spatial dimension, asymmetric
because a block that already carries halos is called with 0 on those sides; output size
``(n + lo + hi - k) // s + 1``; shape mismatches raise ``ValueError``.  Back ends never
import the front doors (a contract in pyproject.toml).
"""
