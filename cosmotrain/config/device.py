"""Rules of the ``device`` section that need no probe of the machine.

A setting that only means something on a GPU (TF32 math, a GPU convolution algorithm,
a way of moving GPU buffers) contradicts a CPU backend.  With ``backend: cpu`` the
loader rejects it at once (``cosmotrain config`` shows it); with ``backend: auto`` the
answer depends on the machine, so :func:`cosmotrain.device.select.decide` applies the same
rule once the ranks have probed theirs.
"""

from __future__ import annotations

from cosmotrain.config.schema import AUTO, DeviceConfig
from cosmotrain.errors import ConfigError


def check_cpu_settings(cfg: DeviceConfig, why: str = "") -> None:
    """Raise for a GPU-only setting when the backend is the CPU (``why``: how auto chose)."""
    gpu_only = (("device.precision", cfg.precision == "tf32",
                 "tf32 is a GPU math mode", "use precision fp32 or bf16"),
                ("device.conv_algorithm", cfg.conv_algorithm != AUTO,
                 f"{cfg.conv_algorithm} selects GPU convolutions", "leave it auto"),
                ("device.cudnn_autotune", cfg.cudnn_autotune,
                 "cudnn_autotune times GPU convolutions", "leave it false"),
                ("device.cuda_graph", cfg.cuda_graph is True,
                 "cuda_graph captures GPU steps", "leave it auto"),
                ("device.conv1_channels_pad", cfg.conv1_channels_pad != 0,
                 "conv1_channels_pad pads GPU convolutions", "leave it 0"),
                ("device.conv1_algorithm", cfg.conv1_algorithm != "default",
                 f"{cfg.conv1_algorithm} selects a GPU convolution", "leave it default"),
                ("device.communication", cfg.communication != "staging",
                 f"{cfg.communication} moves GPU buffers", "leave it staging"))
    for key, wrong, problem, fix in gpu_only:
        if wrong:
            raise ConfigError(key, f"{problem}, but the backend is cpu{why}",
                              f"{fix} on the cpu backend, or run with device.backend: gpu")


def check_device(cfg: DeviceConfig) -> None:
    """What the loader can tell without the machine: an explicit cpu backend."""
    if cfg.backend == "cpu":
        check_cpu_settings(cfg)
