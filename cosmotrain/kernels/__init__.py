"""Local compute kernels: the per-device operations that the distributed layers call.

A kernel works on one rank's local block and knows nothing about MPI, halos or the
process grid.  Each operation is a module of plain functions on C-contiguous NCDHW
arrays, named the same on every device, so that a device implementation (this package:
CPU, numpy + BLAS; CUDA, under :mod:`.cuda`) can be swapped without touching the layers:

* :mod:`.conv3d`: ``conv3d_forward(x, w, stride, padding)``,
  ``conv3d_backward_data(dy, w, x_shape, stride, padding)``,
  ``conv3d_backward_filter(x, dy, w_shape, stride, padding)``;
* :mod:`.pool3d`: ``avg_pool3d_forward / avg_pool3d_backward`` and
  ``max_pool3d_forward -> (y, argmax) / max_pool3d_backward``;
* element-wise kernels (activation, batch norm, dropout, linear, loss) in their modules.

Shared conventions (:mod:`.geometry`): ``stride`` and ``kernel`` are triples (or ints);
``padding`` is one ``(lo, hi)`` pair of zero padding per spatial dimension, asymmetric
because a block that already carries halos is called with 0 on those sides and the true
padding only on global boundaries.  Output size ``(n + lo + hi - k) // s + 1``.  Shape
mismatches raise ``ValueError``; a batch of no sample (``N = 0``: a sample group left
empty by a short batch, which still runs its layers for their collectives) is valid and
gives empty results and zero weight gradients.  The CPU kernels accept float32
(training) and float64 (tests), run their chunks on a small worker pool
(:mod:`cosmotrain.kernels.cpu.workers`) and never import torch.  float32 work goes, where it pays, to the
compiled loops of ``native/`` (one optional C extension, :mod:`.compiled`): direct and
Winograd convolutions (:mod:`.direct`, :mod:`.winograd`, chosen by
:mod:`.compiled_choice`), pooling, LeakyReLU and the optimizer updates, each with a
numpy twin for installs without a C compiler.

Other devices and storage go through the same names: cupy arrays reach the CUDA
kernels under :mod:`.cuda` (convolutions through the cuDNN frontend or im2col + cuBLAS,
:mod:`.cuda.conv`; fused element-wise kernels, :mod:`.cuda.fused`) and the xp-generic
pooling (:mod:`.pool3d_xp`), with the array module of :mod:`cosmotrain.device.xp`;
bfloat16 arrays (``precision: bf16``) are computed in float32 and stored back as
bfloat16 (:mod:`cosmotrain.precision`).
"""
