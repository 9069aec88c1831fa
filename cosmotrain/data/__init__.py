"""CosmoFlow data: formats, the synthetic generator, the manifest, the order and the readers.

``formats`` (HDF5 samples, hyperslab reads), ``synthetic`` and ``datagen`` (generated
datasets), ``scan`` / ``manifest`` / ``sample_table`` / ``cache`` (describing a dataset
once), ``order`` (the epoch's batches, pure), ``placement`` (a rank's block of a batch),
``reader`` / ``preload`` / ``direct`` / ``prefetch`` / ``transform`` (the two readers),
``preload_memory`` (the host memory the preload reader may fill), ``open`` (opening a
job's dataset and building its readers from a config) and ``staging`` (``cosmotrain
preload``).  The collective error helpers it uses are in :mod:`cosmotrain.comm.collective`.
See docs/DATA.md.
"""
