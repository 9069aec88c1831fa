"""Build of cosmotrain's compiled parts; everything else is in pyproject.toml.

``cosmotrain.kernels.compiled._directconv`` is a plain shared library of convolution and
pooling loops (cosmotrain/kernels/compiled/native/*.c), loaded with ctypes by
cosmotrain/kernels/compiled/library.py.  ``cosmotrain.device._step_arena`` is a CPython
extension: numpy's data allocator with the planned arena of cosmotrain/device/step_memory.py,
built against numpy's headers (a build requirement in pyproject.toml).
Both are optional: without a C compiler the install still succeeds, the numpy kernels
run instead and glibc's heap alone keeps freed memory (``cosmotrain info`` says which).
"""

import numpy
from setuptools import Extension, setup

NATIVE = "cosmotrain/kernels/compiled/native"

setup(ext_modules=[Extension(
    "cosmotrain.device._step_arena",
    sources=["cosmotrain/device/native/step_arena.c"],
    include_dirs=[numpy.get_include()],
    optional=True,
), Extension(
    "cosmotrain.kernels.compiled._directconv",
    sources=[f"{NATIVE}/{name}.c" for name in
             ("direct", "maxpool", "avgpool", "optim", "activation", "winograd_weights")],
    depends=[f"{NATIVE}/{name}.h" for name in
             ("direct_body", "winograd_body", "winograd_tiles", "isa_loops")],
    # errno is never read: sqrtf may then be one vector instruction (native/optim.c).
    # -fno-wrapv undoes the -fwrapv of Python's own CFLAGS: with wrapping signed ints GCC
    # cannot widen the loops' int indices, and the 2x2x2 max pooling ran at half speed
    # (MLPerf pool1, one core: 59 ms against 27; docs/PERFORMANCE.md).  No loop here
    # relies on signed overflow.
    extra_compile_args=["-fno-math-errno", "-fno-wrapv"],
    optional=True,
)])
