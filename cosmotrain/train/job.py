"""Everything a training (or prediction) run sets up before its first step.

From a validated config and the job's communicator: BLAS threads per rank, the device
(``device`` section: backend, GPU binding, precision; checked on every rank alike), the
process grid, the output directory, the dataset (generated first when
``data.source`` is synthetic), the distributed model with its optimizer, and one reader
per split placed on this rank's input block.  Collective: every rank builds the same.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosmotrain.comm.grid import ProcessGrid
from cosmotrain.comm.threads import job_threads
from cosmotrain.config.layout import AXES, resolve_parallel
from cosmotrain.config.schema import Config
from cosmotrain.data import datagen, synthetic
from cosmotrain.data.manifest import Manifest
from cosmotrain.data.open import dataset_root, make_readers, open_dataset
from cosmotrain.data.placement import BlockPlacement
from cosmotrain.data.reader import Reader
from cosmotrain.device.select import select_device
from cosmotrain.errors import ConfigError
from cosmotrain.train.step import HybridStep, hybrid_step_from_config, job_runtime

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
    notes: list[str] = field(default_factory=list)  # what rank 0 says of the set-up

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()


def ensure_synthetic_data(cfg: Config, comm: Any) -> str | None:
    """Generate the built-in synthetic dataset under ``output.dir/data`` once (collective);
    returns a line saying what was generated, where and how long it took (None when the
    dataset was already there or ``data.source`` is files)."""
    if cfg.data.source != "synthetic":
        return None
    root = dataset_root(cfg)
    if (root / datagen.MANIFEST_NAME).is_file():
        check_synthetic_settings(root, cfg)
        LOG.debug("synthetic dataset already in %s: not generated again", root)
        return None
    syn = cfg.data.synthetic
    started = time.perf_counter()
    # No manifest: sample files there are this run's own generation, stopped midway (a
    # signal during start-up); the generator is deterministic, so generate them all again.
    manifest = datagen.generate_dataset(root, syn.samples, cfg.model.width, syn.seed,
                                        val_fraction=syn.val_fraction, comm=comm,
                                        overwrite=True)
    counts = ", ".join(f"{split['count']} {name}" for name, split in
                       manifest["splits"].items())
    return (f"cosmotrain: generated {syn.samples} synthetic samples ({counts}, "
            f"{cfg.model.width}^3, seed {syn.seed}) in {root} in "
            f"{time.perf_counter() - started:.1f} s")


def check_synthetic_settings(root: Path, cfg: Config) -> None:
    """Raise a :class:`ConfigError` when the synthetic dataset already in ``root`` was
    generated with other settings than ``cfg`` asks for (every rank reads the same
    manifest: collective).  Why: it is reused rather than generated again, and a run that
    changed ``data.synthetic`` or ``model.width`` would otherwise train on the old data
    without a word.  The data is never replaced here: the message says how."""
    try:
        manifest = json.loads((root / datagen.MANIFEST_NAME).read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise ConfigError("data.source", f"synthetic, but {root / datagen.MANIFEST_NAME} "
                          f"cannot be read ({err})", f"remove {root} to generate it anew")
    syn = cfg.data.synthetic
    wanted = {"generator": synthetic.GENERATOR_NAME, "samples": syn.samples,
              "width": cfg.model.width, "seed": syn.seed, "val_fraction": syn.val_fraction}
    differ = [f"{key} {manifest.get(key)!r} where the config asks for {value!r}"
              for key, value in wanted.items() if manifest.get(key) != value]
    if differ:
        raise ConfigError("data.synthetic", f"the dataset already in {root} was made with "
                          f"{'; '.join(differ)}",
                          f"remove or rename {root} to generate it anew, or choose another "
                          f"output.dir")


def build_job(cfg: Config, comm: Any, splits: tuple[str, ...] | None = None,
              training: bool = True) -> Job:
    """Set up a run of ``cfg`` on ``comm`` (collective).

    ``training`` requires labels in every split read; prediction (False) reads each split
    in dataset order, never shuffled, and accepts unlabelled files.
    """
    threads = job_threads(comm)
    layout = resolve_parallel(cfg, comm.Get_size())
    device = select_device(cfg.device, comm)
    grid = ProcessGrid(comm, layout)
    LOG.debug("layout %s on %d rank(s): this rank at %s; %s; %d BLAS thread(s)",
              layout.describe(), comm.Get_size(),
              " ".join(f"{axis}={at}" for axis, at in zip(AXES, grid.coords)),
              device.describe(), threads.blas)
    out_dir = Path(cfg.output.dir)
    generated = ensure_synthetic_data(cfg, comm)
    step = hybrid_step_from_config(cfg, grid, job_runtime(cfg, grid, device, threads))
    manifest = open_dataset(cfg, comm)
    width = cfg.model.width
    dist, coord = step.model.input_distribution(
        (cfg.train.batch_size, cfg.model.channels, width, width, width))
    for split in (splits or manifest.splits) if training else ():
        manifest.require_labels(split)
    shuffle = None if training else {split: False for split in splits or manifest.splits}
    readers = make_readers(cfg, manifest, comm, BlockPlacement.from_distribution(dist, coord),
                           splits, shuffle=shuffle)
    return Job(cfg, comm, grid, step, manifest, readers, out_dir,
               [generated] if generated else [])
