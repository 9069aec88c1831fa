"""Copies of a dataset: ``cosmotrain preload`` and ``cosmotrain convert``.

``stage`` (staging onto node-local storage, every copy checked against its source's
checksum), ``stage_claim`` (whose copy a stage directory holds, so that staging never
writes over another dataset) and ``convert`` (a dataset rewritten in another format).
"""
