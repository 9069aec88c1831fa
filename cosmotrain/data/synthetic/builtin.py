"""The built-in synthetic dataset of a run (``data.source: synthetic``), made once.

A step of its own, before the job is built: the run's start-up (``train/run.py``)
calls :func:`ensure_synthetic_data`, and nothing else does (``predict`` reads the files
it is given).  The dataset lives in ``output.dir/data`` and is reused by later runs of the
same settings, refused with a clear line when the settings changed.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from cosmotrain.config.schema import Config
from cosmotrain.data.synthetic import datagen, universes as synthetic
from cosmotrain.data.readers.job_readers import dataset_root
from cosmotrain.errors import ConfigError

LOG = logging.getLogger(__name__)


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
