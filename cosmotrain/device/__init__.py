"""Devices: array modules, device probing and selection, transports.

What this package owns:

* :mod:`.xp`: the array module of arrays (numpy / cupy), ``to_host``, the one deliberate
  ``import cupy``; a leaf that imports nothing from cosmotrain;
* :mod:`.probe`: what one rank finds on its machine (cupy, CUDA devices, NCCL,
  ml_dtypes, its place on its node);
* :mod:`.select`: the :class:`~.select.Device` value, the collective decision from every
  rank's probe, and GPU binding (local rank -> GPU);
* :mod:`.transport`: how buffers cross MPI (host, staging, CUDA-aware, NCCL), one module
  each, behind ``make_transport(mode)``.

What it may import: numpy, mpi4py and the optional GPU libraries (cupy, cupyx,
cupy.cuda.nccl, ml_dtypes), and from cosmotrain only what sits below it: ``config`` (the
device section and its checks), ``errors`` and ``precision``.  It never imports
``comm`` (the transports take MPI communicators as arguments; ``comm``, ``tensor`` and
the layers import this package) nor ``kernels`` (kernel choices that depend on the
device, such as the convolution settings, live in ``kernels.cuda`` and read the
:class:`~.select.Device`).

This ``__init__`` imports nothing, so importing the array-module leaf stays light: import
from the modules.
"""
