"""Synthetic CosmoFlow data whose 4 parameters can be learned from the field.

``universes`` (the generator of fields and their parameters), ``datagen`` (``cosmotrain
datagen``: a dataset of per-sample files, a split and a manifest) and ``builtin`` (a run's
built-in dataset, ``data.source: synthetic``, made once before the job is built).
"""
