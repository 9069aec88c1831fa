"""Everything a training (or prediction) run sets up before its first step.

From a validated config and the job's communicator: BLAS threads per rank, the device
(``device`` section: backend, GPU binding, precision; checked on every rank alike), the
process grid and the distributed model with its optimizer (:func:`build_step`, which
``train --dry-run`` shares), then the dataset and one reader per split placed on this
rank's input block.  Collective: every rank builds the same.  The built-in synthetic
dataset is made by its own step before this (:mod:`cosmotrain.data.synthetic.builtin`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.kernels.cpu.workers import KernelThreads
from cosmotrain.runtime.threads import job_threads
from cosmotrain.config.layout import AXES, resolve_parallel
from cosmotrain.config.schema import Config
from cosmotrain.data.dataset.manifest import Manifest
from cosmotrain.data.readers.job_readers import make_readers, open_dataset
from cosmotrain.data.readers.placement import BlockPlacement
from cosmotrain.data.readers.base import Reader
from cosmotrain.device.select import Device, select_device
from cosmotrain.errors import UserError
from cosmotrain.engine.step import HybridStep, hybrid_step_from_config, job_runtime

LOG = logging.getLogger(__name__)


@dataclass
class Job:
    """A configured run: grid, model step, readers, output directory."""

    cfg: Config
    comm: Any
    grid: ProcessGrid
    step: HybridStep
    manifest: Manifest
    readers: dict[str, Reader]
    out_dir: Path

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


def build_step(cfg: Config, comm: Any, threads: KernelThreads | None = None
               ) -> tuple[ProcessGrid, HybridStep, Device]:
    """The grid, the training step and the device of ``cfg`` on ``comm`` (collective).

    ``threads``: the kernel threads a run applies to this process (None: none applied,
    as ``train --dry-run`` wants).  The grid is freed when the step cannot be built."""
    layout = resolve_parallel(cfg, comm.Get_size())
    device = select_device(cfg.device, comm)
    grid = ProcessGrid(comm, layout)
    LOG.debug("layout %s on %d rank(s): this rank at %s; %s%s", layout.describe(),
              comm.Get_size(), " ".join(f"{axis}={at}" for axis, at in zip(AXES, grid.coords)),
              device.describe(), f"; {threads.blas} BLAS thread(s)" if threads else "")
    try:
        step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device, threads))
    except UserError:
        grid.free()
        raise
    return grid, step, device


def build_job(cfg: Config, comm: Any, splits: tuple[str, ...] | None = None,
              training: bool = True) -> Job:
    """Set up a run of ``cfg`` on ``comm`` (collective).

    ``training`` requires labels in every split read; prediction (False) reads each split
    in dataset order, never shuffled, and accepts unlabelled files.
    """
    threads = job_threads(comm)
    grid, step, _ = build_step(cfg, comm, threads)
    out_dir = Path(cfg.output.dir)
    manifest = open_dataset(cfg, comm)
    width = cfg.model.width
    dist, coord = step.model.input_distribution(
        (cfg.train.batch_size, cfg.model.channels, width, width, width))
    for split in (splits or manifest.splits) if training else ():
        manifest.require_labels(split)
    shuffle = None if training else {split: False for split in splits or manifest.splits}
    readers = make_readers(cfg, manifest, comm, BlockPlacement.from_distribution(dist, coord),
                           splits, shuffle=shuffle)
    if training and "train" in readers:  # int16 batches go to the device as they are stored
        readers["train"].keep_stored = step.device.is_gpu
    return Job(cfg, comm, grid, step, manifest, readers, out_dir)
