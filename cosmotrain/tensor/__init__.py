"""Distributed tensors: pure block/halo index math (``distribution``, ``windows``), the
interior/shell plans of window layers (``interior``), channel/filter blocks and their
communication volumes (``channel_split``), local blocks with halo margins, halo exchange
and redistribution."""
