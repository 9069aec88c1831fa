"""Distributed layers: the single-process layers of ``nn`` on :class:`DistTensor` blocks."""
