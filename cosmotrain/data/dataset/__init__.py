"""A dataset described once: its files, shape, labels, checksums, and whether it is whole.

``scan`` (a directory without a manifest, as downloaded), ``manifest`` (files per split,
on-disk shape, model-width sub-cubes, labels, means), ``sample_table`` (per-file labels
and per-sample means, built once, collectively), ``cache`` (where the cached manifest and
tables live), ``file_sums`` (each file's size and CRC-32C, and the dataset's identity),
``verify`` (``data.verify``) and ``unfinished`` (a stage or conversion that did not
finish is refused).
"""
