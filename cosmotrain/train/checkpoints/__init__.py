"""Checkpoints: writing, verifying and resuming a run's training state.

``checkpoint`` (the HDF5 file, written atomically, retention, finding the newest intact
one), ``checksums`` (the data and metadata checksums verified on load), ``full_state``
(the training state as full arrays under any layout, and back), ``resume`` (restoring a
run), ``resume_check`` (whether a checkpoint may resume under this config) and
``resume_data`` (the same dataset at another path is the same data).
"""
