"""The numpy back ends of the kernels (float32 training, float64 tests).

``workers`` (the kernel worker pool and the BLAS threads it runs with), ``conv_gemm``
(convolution as GEMMs over lowered blocks), ``conv_dgrad``, ``lowering`` and
``depth_lowering`` (the lowerings), ``pooling`` (average and max pooling by strided
passes), ``maxpool_tiled`` (2x2x2 max pooling on contiguous passes) and
``channel_sums`` (bias gradients on the workers).  Front doors in :mod:`cosmotrain.kernels`
choose them.
"""
