"""An explicit ``parallel.spatial_until`` whose blocks are thinner than a halo is refused.

The rule is the engine's own (``tensor.windows.check_halos``, which the halo exchange
applies at the first step): ``layers.hybrid.spatial_stop`` applies it to every convolution
and pooling before a named stop when the model is built, so ``train`` and
``train --dry-run`` both refuse such a stop in one line naming the key, the layer and the
fix, instead of a traceback at the first step.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cosmotrain.config import load_config
from cosmotrain.errors import ConfigError
from cosmotrain.layers.hybrid import spatial_stop
from cosmotrain.models import build_model

TIMEOUT = 120


def model_of(name: str, width: int):  # noqa: ANN201 - a Sequential
    cfg = load_config(None, [f"model.name={name}", f"model.width={width}"])
    return build_model(cfg.model, 0)


@pytest.mark.parametrize("name, width, ways, until, layer, stop", [
    # tiny at W=8 over D4: conv2 reads 1-plane blocks with a stride-2 window
    ("tiny", 8, (4, 1, 1), "pool2", "conv2", "conv2"),
    ("tiny", 16, (4, 1, 1), "flatten", "pool2", "pool2"),
    ("tiny", 16, (1, 4, 1), "flatten", "pool2", "pool2"),
    # a layer nested in a residual block is named by its dotted path
    ("resnet3d", 8, (4, 1, 1), "avgpool", "layer3.0.conv1", "layer3"),
])
def test_named_stop_past_a_halo_the_blocks_cannot_serve(name: str, width: int,
                                                         ways: tuple[int, int, int],
                                                         until: str, layer: str,
                                                         stop: str) -> None:
    model = model_of(name, width)
    with pytest.raises(ConfigError) as info:
        spatial_stop(model, (2, 4, width, width, width), ways, until)
    message = str(info.value)
    assert info.value.key == "parallel.spatial_until" and "\n" not in message
    assert f"'{until}' keeps layer '{layer}'" in message and "smaller than the halo" in message
    assert f"stop at or before '{stop}'" in message


@pytest.mark.parametrize("name, width, ways", [
    ("tiny", 8, (4, 1, 1)), ("tiny", 16, (4, 1, 1)), ("tiny", 16, (2, 2, 2)),
    ("cosmoflow", 16, (4, 1, 1)), ("resnet3d", 16, (2, 2, 1)),
])
def test_the_auto_stop_and_every_earlier_named_stop_pass(name: str, width: int,
                                                          ways: tuple[int, int, int]) -> None:
    """The check refuses no stop the engine can run: auto and the stops up to it pass."""
    model = model_of(name, width)
    shape = (2, 4, width, width, width)
    auto = spatial_stop(model, shape, ways)
    names = [layer.name for layer in model.items]
    for index in range(auto + 1 if auto < len(names) else auto):
        assert spatial_stop(model, shape, ways, names[index]) == index


def test_train_and_dry_run_refuse_it_once_under_four_ranks(tmp_path) -> None:  # noqa: ANN001
    from conftest import REPO, mpiexec, subprocess_env

    sets = ["model.width=8", "parallel.depth=4", "parallel.spatial_until=pool2",
            "train.batch_size=4", "train.max_steps=1", f"output.dir={tmp_path / 'run'}"]
    base = [mpiexec(), "-n", "4", sys.executable, "-m", "cosmotrain", "train", "--config",
            str(REPO / "configs" / "tiny.yaml")] + [a for s in sets for a in ("--set", s)]
    for extra in (["--dry-run"], []):
        job = subprocess.run(base + extra, capture_output=True, text=True, timeout=TIMEOUT,
                             env=subprocess_env())
        assert job.returncode == 2, f"{extra}: exit {job.returncode}\n{job.stderr}"
        assert job.stderr.count("cosmotrain: error:") == 1, job.stderr
        assert job.stderr.count("config key 'parallel.spatial_until': 'pool2' keeps layer "
                                "'conv2'") == 1, job.stderr
        assert "Traceback" not in job.stderr, job.stderr
