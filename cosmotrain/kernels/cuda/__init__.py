"""CUDA kernels (cupy arrays): 3D convolutions through cuDNN or im2col + cuBLAS, fused
element-wise kernels.

* :mod:`.conv`: ``conv3d_forward``, ``conv3d_backward_data``, ``conv3d_backward_filter``
  (the CPU kernels' signatures and semantics, plus ``settings=``;
  :mod:`cosmotrain.kernels.conv3d` hands cupy arrays to them);
* :mod:`.settings`: ``ConvSettings`` (a value: the job's runtime holds it and the layers
  pass it to every call), ``settings_for(device)``, and ``cublas_math`` (TF32 on/off for
  cupy's float32 GEMMs);
* :mod:`.conv_cudnn`: cuDNN Frontend graphs, cached per shape;
* :mod:`.conv_gemm`: the im2col + ``xp.matmul`` fallback, also runnable (and tested) on numpy;
* :mod:`.fused`: cupy ``ElementwiseKernel`` / ``ReductionKernel`` for LeakyReLU and batch
  norm (:mod:`cosmotrain.kernels.activation`, :mod:`cosmotrain.kernels.batchnorm`) on
  strided views;
* :mod:`.raw` / :mod:`.raw_ops` / :mod:`.raw_bn`: our own CUDA sources (``src/*.cu``) and
  their Python faces (``raw_bn``: batch norm's).

Imports :mod:`cosmotrain.device.xp` (the array module) and :mod:`cosmotrain.kernels.geometry`;
importing this package imports neither cupy nor cudnn; both are imported on first use.
See docs/GPU_KERNELS.md.
"""

from cosmotrain.kernels.cuda.conv import (algorithm, conv3d_backward_data, conv3d_backward_filter, conv3d_forward,
                   cudnn_status)
from cosmotrain.kernels.cuda.settings import ConvSettings, cublas_math, settings_for

__all__ = ["ConvSettings", "algorithm", "conv3d_backward_data", "conv3d_backward_filter",
           "conv3d_forward", "cublas_math", "cudnn_status", "settings_for"]
