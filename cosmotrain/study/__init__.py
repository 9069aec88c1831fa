"""Measuring performance by running the engine: calibration, layer timing, scale studies.

Owns ``cosmotrain calibrate`` (``calibrate``: fits a machine model by timing the engine's
own layers and collectives over MPI; ``layer_timing``: layer times inside whole steps),
the quick estimate of a machine never calibrated (``estimate``: a few seconds in one
process, cached, for ``plan`` and ``parallel: auto`` out of the box) and
``cosmotrain scale-study`` (``scale``: the study driver; ``points``: which rank counts and
strategies; ``launch``: srun / mpiexec runs of ``cosmotrain train``; ``report``: measured
step, speedup, efficiency and the results files; ``plots``: PNG figures, which ``report``
calls with the data they draw and which never import ``report``).

May import ``train`` and ``plan`` and everything below them; only ``cli`` imports it.
"""
