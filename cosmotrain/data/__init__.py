"""CosmoFlow data: formats, the synthetic generator, the manifest, the order and the readers.

``formats`` (HDF5 samples, hyperslab reads), ``synthetic`` and ``datagen`` (generated
datasets), ``scan`` / ``manifest`` / ``sample_table`` / ``cache`` (describing a dataset
once), ``order`` (the epoch's batches, pure), ``placement`` (a rank's block of a batch),
``reader`` / ``preload`` / ``direct`` / ``prefetch`` / ``transform`` / ``memory`` (the two
readers), ``readers`` (building them from a config) and ``staging`` (``cosmotrain
preload``).  See docs/DATA.md.
"""
