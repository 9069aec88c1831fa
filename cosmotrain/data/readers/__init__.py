"""The readers: each rank receives its own block of every global batch.

``base`` (what every reader delivers), ``order`` (the epoch's order, a pure function of
seed, epoch and count), ``placement`` (a rank's block of a batch, and which ranks share
it), ``preload`` + ``preload_memory`` (the preload-and-shuffle store and the host memory
it may fill), ``direct`` (each rank reads its own block from the files every step),
``prefetch`` (the next batch read while this one computes), ``transform`` (log1p or the
mean, applied on delivery) and ``job_readers`` (a job's dataset opened and its readers
built from its config).
"""
