"""Distributed layers: the single-process layers of ``nn`` on :class:`DistTensor` blocks.

Spatially partitioned convolution and pooling (``conv``, ``pool``, sharing ``windowed``:
what a window layer does with its halo buffer),
channel/filter parallel convolution (``channel_conv``, its algorithm choice in
``channel_plan``), batch norm over the ranks that share its statistics (``batchnorm``),
element-wise layers (``blockwise``), the hand-over from spatial blocks to whole samples
(``to_samples``), the loss (``loss``), sharded parameters (``shards``) and the hybrid
model built from a serial one (``hybrid``).  Layers never call MPI directly: they use the
grid's communicators and the ``tensor`` routines.
"""
