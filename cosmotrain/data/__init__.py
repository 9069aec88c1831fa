"""CosmoFlow data, in five rooms.

``formats/`` (what a sample is, and the HDF5, MLPerf TFRecord and NVIDIA numpy files that
hold one), ``dataset/`` (a dataset described once: scan, manifest, label and mean tables,
checksums, completeness), ``readers/`` (the preload-and-shuffle and direct readers: each
rank receives its own block of every batch), ``synthetic/`` (generated data) and
``copies/`` (``cosmotrain preload`` and ``cosmotrain convert``).  The collective error
helpers it uses are in :mod:`cosmotrain.comm.collective`.  See docs/DATA.md.
"""
