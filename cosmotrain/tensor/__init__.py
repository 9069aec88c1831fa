"""Distributed tensors: pure block/halo index math (``distribution``, ``windows``), local
blocks with halo margins, halo exchange and redistribution."""
