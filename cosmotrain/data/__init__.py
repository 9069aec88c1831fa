"""CosmoFlow data: HDF5 sample formats, the synthetic generator and dataset writing."""
