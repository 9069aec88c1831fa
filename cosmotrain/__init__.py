"""cosmotrain: hybrid-parallel training of 3D CNNs on large scientific volumes."""

__version__ = "0.1.0"
