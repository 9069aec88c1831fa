"""Distributed tensors and all their distribution geometry.

Pure index math, tested without MPI: blocks (``distribution``), boxes of indices
(``boxes``), window spans and halo widths (``windows``), one rank's halo buffer
(``halo_buffers``), the interior/shell plans of convolutions (``interior``), channel/filter
blocks and their communication volumes (``channel_split``).  On top: local blocks
(``dist_tensor``), halo exchange (``halo``), redistribution (``redistribute``) and the
channel collectives."""
