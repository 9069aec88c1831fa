"""Build of cosmotrain's compiled parts; everything else is in pyproject.toml.

``cosmotrain.kernels._directconv`` is a plain shared library of convolution and pooling
loops (cosmotrain/kernels/native/*.c), loaded with ctypes by
cosmotrain/kernels/compiled.py.  ``cosmotrain.device._step_arena`` is a CPython extension:
numpy's data allocator with the planned arena of cosmotrain/device/step_memory.py, built
against numpy's headers (a build requirement in pyproject.toml).
Both are optional: without a C compiler the install still succeeds, the numpy kernels
run instead and glibc's heap alone keeps freed memory (``cosmotrain info`` says which).
"""

import numpy
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "cosmotrain.device._step_arena",
    sources=["cosmotrain/device/native/step_arena.c"],
    include_dirs=[numpy.get_include()],
    optional=True,
), Extension(
    "cosmotrain.kernels._directconv",
    sources=["cosmotrain/kernels/native/direct.c", "cosmotrain/kernels/native/maxpool.c",
             "cosmotrain/kernels/native/avgpool.c", "cosmotrain/kernels/native/optim.c",
             "cosmotrain/kernels/native/activation.c",
             "cosmotrain/kernels/native/winograd_weights.c"],
    depends=["cosmotrain/kernels/native/direct_body.h",
             "cosmotrain/kernels/native/winograd_body.h",
             "cosmotrain/kernels/native/winograd_tiles.h",
             "cosmotrain/kernels/native/isa_loops.h"],
    # errno is never read: sqrtf may then be one vector instruction (native/optim.c).
    # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS: with wrapping signed ints GCC
    # cannot widen the loops' int indices, and the 2x2x2 max pooling ran at half speed
    # (MLPerf pool1, one core: 59 ms against 27; docs/PERFORMANCE.md).  No loop here
    # relies on signed overflow.
    extra_compile_args=["-fno-math-errno", "-fno-wrapv"],
    optional=True,
)])
