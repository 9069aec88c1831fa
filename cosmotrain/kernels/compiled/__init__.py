"""The compiled CPU back ends: C loops (``native/*.c``, one optional extension) and their
Python faces.

``library`` (loading the shared library with ctypes), ``choice`` (direct or Winograd per
call), ``direct`` and ``winograd`` (convolutions), ``avgpool`` (average pooling).  Every
path has a numpy twin in :mod:`cosmotrain.kernels.cpu` for installs without a C compiler.
"""
