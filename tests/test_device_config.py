"""The ``device`` section: schema, shorthand, validation, GPU binding (no GPU needed).

Device selection is a pure function of the config and every rank's probe
(:func:`cosmotrain.device.select.decide`), so the rules are tested here with made-up probes:
nodes with and without cupy or devices, NCCL, several ranks per GPU.  The CLI tests
replace the machine probe with a fake, so they mean the same on a GPU machine.
"""

from __future__ import annotations

import pytest

from cosmotrain.config.load import load_config
from cosmotrain.config.schema import DeviceConfig
from cosmotrain.device import select as backend
from cosmotrain.device.select import Device, Probe, bind, decide, host_device
from cosmotrain.errors import ConfigError


def gpu_node(host: str, ranks: int, devices: int, nccl: bool = True) -> list[Probe]:
    """The probes of ``ranks`` ranks on one node that sees ``devices`` GPUs."""
    return [Probe(host, r, ranks, "14.2.0", devices, "" if devices else "no device", nccl,
                  True) for r in range(ranks)]


def cpu_node(host: str, ranks: int, cupy: bool = False) -> list[Probe]:
    problem = "CUDA reports no usable device" if cupy else "cupy does not import"
    return [Probe(host, r, ranks, "14.2.0" if cupy else "", 0, problem, False, True)
            for r in range(ranks)]


def test_device_section_defaults_and_shorthand() -> None:
    cfg = load_config(None)
    assert (cfg.device.backend, cfg.device.precision, cfg.device.conv_algorithm,
            cfg.device.communication, cfg.device.gpus_per_node) == \
        ("auto", "fp32", "auto", "staging", "auto")
    assert load_config(None, ["backend=gpu"]).device.backend == "gpu"
    assert load_config(None, ["backend=cpu", "device.precision=bf16"]).device.backend == "cpu"
    assert load_config(None, ["device.gpus_per_node=2"]).device.gpus_per_node == 2
    assert load_config(None).device.cudnn_autotune is False


def test_cudnn_autotune_reaches_the_convolution_settings() -> None:
    from cosmotrain.kernels.cuda.settings import settings_for

    tuned = decide(DeviceConfig(backend="gpu", cudnn_autotune=True), gpu_node("a", 1, 1), 0)
    assert tuned.cudnn_autotune and "cuDNN plans autotuned" in tuned.describe()
    assert settings_for(tuned).cudnn_autotune is True
    plain = decide(DeviceConfig(backend="gpu"), gpu_node("a", 1, 1), 0)
    assert settings_for(plain).cudnn_autotune is False
    assert settings_for(plain).cudnn_layout == "ncdhw"  # measured faster (settings.py)


def test_conv1_settings_reach_the_convolution_settings() -> None:
    from cosmotrain.kernels.cuda.settings import ConvSettings, settings_for

    assert (load_config(None).device.conv1_channels_pad,
            load_config(None).device.conv1_algorithm) == (0, "default")
    cfg = load_config(None, ["backend=gpu", "device.conv1_channels_pad=8",
                             "device.conv1_algorithm=direct"]).device
    chosen = decide(cfg, gpu_node("a", 1, 1), 0)
    assert "conv1 channels padded to a multiple of 8, direct kernel" in chosen.describe()
    settings = settings_for(chosen)
    assert (settings.conv1_channels_pad, settings.conv1_algorithm) == (8, "direct")
    assert "conv1" not in decide(DeviceConfig(backend="gpu"), gpu_node("a", 1, 1),
                                 0).describe()
    for bad in ({"conv1_channels_pad": -1}, {"conv1_channels_pad": True},
                {"conv1_algorithm": "cudnn"}):
        with pytest.raises(ValueError, match="ConvSettings.conv1_"):
            ConvSettings(**bad)


def test_device_section_rejects_bad_values_naming_the_key() -> None:
    cases = {
        "device.precision=fp16": "device.precision",
        "device.communication=mpi": "device.communication",
        "device.gpus_per_node=0": "device.gpus_per_node",
        "device.backend=cuda": "device.backend",
        "device.conv1_channels_pad=-8": "device.conv1_channels_pad",
        "device.conv1_algorithm=winograd": "device.conv1_algorithm",
    }
    for override, key in cases.items():
        with pytest.raises(ConfigError, match=f"'{key}'"):
            load_config(None, [override])
    with pytest.raises(ConfigError, match="'backend'.*contradicts"):
        load_config(None, ["backend=gpu", "device.backend=cpu"])


@pytest.mark.parametrize("override, key", [
    ("device.precision=tf32", "device.precision"),
    ("device.conv_algorithm=cudnn", "device.conv_algorithm"),
    ("device.communication=nccl", "device.communication"),
    ("device.cudnn_autotune=true", "device.cudnn_autotune"),
    ("device.conv1_channels_pad=8", "device.conv1_channels_pad"),
    ("device.conv1_algorithm=direct", "device.conv1_algorithm"),
    ("device.cuda_graph=true", "device.cuda_graph"),
])
def test_gpu_only_settings_on_an_explicit_cpu_backend(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'.*backend is cpu"):
        load_config(None, ["device.backend=cpu", override])


def test_auto_chooses_gpu_only_when_every_rank_has_one() -> None:
    cfg = DeviceConfig()
    assert decide(cfg, gpu_node("a", 2, 2) + gpu_node("b", 2, 2), 3).kind == "gpu"
    assert decide(cfg, gpu_node("a", 2, 2) + cpu_node("b", 2), 0) == Device("cpu")
    assert decide(cfg, cpu_node("a", 1, cupy=True), 0) == Device("cpu")


def test_auto_on_cpu_rejects_gpu_only_settings_and_says_why() -> None:
    with pytest.raises(ConfigError, match=r"tf32 .* backend is cpu \(device.backend: auto "
                                          r"found no GPU on rank 1 \(host b\)"):
        decide(DeviceConfig(precision="tf32"), gpu_node("a", 1, 1) + cpu_node("b", 1), 0)


def test_gpu_backend_errors_name_the_rank_host_and_fix() -> None:
    with pytest.raises(ConfigError, match=r"rank 2 \(host b\) has none: cupy does not "
                                          r'import.*pip install -e "\.\[gpu\]"'):
        decide(DeviceConfig(backend="gpu"), gpu_node("a", 2, 1) + cpu_node("b", 2), 0)
    with pytest.raises(ConfigError, match=r"needs a CUDA device on every rank.*rank 0 "
                                          r"\(host a\).*CUDA_VISIBLE_DEVICES"):
        decide(DeviceConfig(backend="gpu"), cpu_node("a", 1, cupy=True), 0)
    with pytest.raises(ConfigError, match=r"'device.gpus_per_node': 4 GPUs asked for, but "
                                          r"rank 0 \(host a\) sees 2"):
        decide(DeviceConfig(backend="gpu", gpus_per_node=4), gpu_node("a", 1, 2), 0)


def test_bf16_needs_ml_dtypes_on_every_rank() -> None:
    probes = gpu_node("a", 2, 2)
    probes[1] = Probe("a", 1, 2, "14.2.0", 2, "", True, ml_dtypes=False)
    with pytest.raises(ConfigError, match=r"bf16 storage needs ml_dtypes.*rank 1.*pip "
                                          r"install ml_dtypes"):
        decide(DeviceConfig(precision="bf16"), probes, 0)


def test_binding_is_local_rank_modulo_the_node_gpus() -> None:
    assert [bind(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    probes = gpu_node("a", 4, 2) + gpu_node("b", 4, 4)
    devices = [decide(DeviceConfig(backend="gpu"), probes, r) for r in range(8)]
    assert [d.index for d in devices] == [0, 1, 0, 1, 0, 1, 2, 3]
    assert [d.shared_by for d in devices] == [2, 2, 2, 2, 1, 1, 1, 1]
    capped = [decide(DeviceConfig(backend="gpu", gpus_per_node=1), probes, r).index
              for r in range(8)]
    assert capped == [0] * 8
    with pytest.raises(ValueError):
        bind(0, 0)


def test_binding_follows_what_cuda_shows_each_rank() -> None:
    """With CUDA_VISIBLE_DEVICES set per rank (srun --gpus-per-task=1) every rank sees
    one device, its own: each binds to device 0 of its view, and sharing is judged by the
    GPUs' PCI bus ids, so none is shared and NCCL is allowed."""
    probes = [Probe("a", r, 4, "14.2.0", 1, "", True, True, (f"0000:{r}1:00.0",))
              for r in range(4)]
    nccl = DeviceConfig(backend="gpu", communication="nccl")
    devices = [decide(nccl, probes, r) for r in range(4)]
    assert [(d.index, d.shared_by) for d in devices] == [(0, 1)] * 4
    same = [Probe("a", r, 2, "14.2.0", 1, "", True, True, ("0000:41:00.0",))
            for r in range(2)]
    assert decide(DeviceConfig(backend="gpu"), same, 1).shared_by == 2


def test_nccl_needs_the_library_and_one_gpu_per_rank() -> None:
    nccl = DeviceConfig(backend="gpu", communication="nccl")
    assert decide(nccl, gpu_node("a", 2, 2) + gpu_node("b", 2, 2), 2).communication == "nccl"
    with pytest.raises(ConfigError, match=r"cupy.cuda.nccl does not load on rank 0.*"
                                          r"nvidia-nccl-cu12 or nvidia-nccl-cu13"):
        decide(nccl, gpu_node("a", 2, 2, nccl=False), 0)
    with pytest.raises(ConfigError, match=r"one GPU per rank.*ranks 0 and 2 share GPU 0 "
                                          r"of host a.*staging"):
        decide(nccl, gpu_node("a", 3, 2), 1)


def test_every_rank_raises_the_same_error() -> None:
    probes = gpu_node("a", 2, 2) + cpu_node("b", 2)
    messages = set()
    for rank in range(4):
        with pytest.raises(ConfigError) as err:
            decide(DeviceConfig(backend="gpu"), probes, rank)
        messages.add(str(err.value))
    assert len(messages) == 1


def test_host_device_and_its_precision() -> None:
    assert host_device(DeviceConfig()) == Device("cpu")
    bf16 = host_device(DeviceConfig(precision="bf16"))
    assert bf16.storage_dtype.name == "bfloat16" and bf16.xp.__name__ == "numpy"
    with pytest.raises(ConfigError, match="tf32"):
        host_device(DeviceConfig(precision="tf32"))
    assert "cpu (numpy), precision bf16" == bf16.describe()
    gpu = Device("gpu", 1, "tf32", "nccl", "cudnn", shared_by=2)
    assert gpu.describe() == ("gpu 1, shared by 2 ranks (cupy), precision tf32, "
                              "convolutions cudnn, communication nccl")


def test_select_device_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collective path (probe, allgather, decide) on one rank, with the machine's GPU
    probe replaced: no cupy -> cpu; devices -> a GPU that ``activate`` would bind."""
    from mpi4py import MPI

    monkeypatch.setattr(backend, "probe_gpu",
                        lambda: ("", 0, "cupy does not import", False, ()))
    assert backend.select_device(DeviceConfig(), MPI.COMM_SELF) == Device("cpu")
    with pytest.raises(ConfigError, match="gpu needs cupy"):
        backend.select_device(DeviceConfig(backend="gpu"), MPI.COMM_SELF)
    probe = backend.probe_rank(MPI.COMM_SELF)
    assert (probe.local_rank, probe.local_size) == (0, 1)


def test_cli_reports_device_errors_with_exit_2(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "probe_gpu",
                        lambda: ("", 0, "cupy does not import", False, ()))
    tiny = ["--set", "model.name=tiny", "--set", "model.width=16"]
    code, _, err = cli("train", "--dry-run", *tiny, "--set", "backend=gpu")
    assert code == 2 and "config key 'device.backend': gpu needs cupy" in err
    assert "Traceback" not in err
    code, _, err = cli("train", "--dry-run", *tiny, "--set", "device.precision=tf32")
    assert code == 2 and "'device.precision': tf32 is a GPU math mode" in err
    code, out, _ = cli("train", "--dry-run", *tiny, "--set", "device.precision=bf16")
    assert code == 0 and "device (rank 0): cpu (numpy), precision bf16" in out
    code, _, err = cli("config", "--set", "backend=cpu", "--set",
                       "device.communication=cuda-aware")
    assert code == 2 and "'device.communication'" in err
