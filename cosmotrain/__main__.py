"""``python -m cosmotrain`` (and ``python -m mpi4py -m cosmotrain``, which aborts the
whole MPI job when one rank raises)."""

from cosmotrain.cli import main

if __name__ == "__main__":
    main()
