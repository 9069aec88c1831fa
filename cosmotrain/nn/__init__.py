"""The small single-process layer framework the networks are built from.

``module`` (parameters, the layer protocol, the context), ``layers`` (convolution,
pooling, batch norm, activations, dropout, flatten, linear: thin wrappers that call the
device kernels), ``containers`` (a sequence of layers, a residual block), ``factory``
(constructors that give layers their parameters), ``init`` (seeded initialisation,
independent of construction order and rank layout) and ``profile`` (per-layer timing).
The distributed layers of :mod:`cosmotrain.layers` run these layers on local blocks.
"""
