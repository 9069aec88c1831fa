"""The sample file formats: what a CosmoFlow sample is, and the files that hold one.

``sample`` (what a sample is whatever file holds it: shapes, layouts, dtypes, checks),
``interface`` (the formats behind one interface: probe, read, write, rename), one module
per format (``hdf5``, ``tfrecord`` with its codec ``tfrecord_codec``, ``npy``: NVIDIA's
``_data.npy`` / ``_label.npy``), and ``read_errors`` (whatever a parsing library raises
on a damaged file, as the one data error naming it).
"""
