"""The configuration schema: one dataclass per YAML section.

Every key is declared once, here, with its type, default, allowed values or range and a
one-line description.  The loader (``load.py``) validates YAML and ``--set`` overrides
against these declarations, so error messages can always name the key path and the fix,
and the README's config reference is generated from the same source
(``cosmotrain config --reference``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"


def spec(default: Any, doc: str, *, choices: tuple[Any, ...] | None = None,
         minimum: float | None = None, maximum: float | None = None,
         exclusive_max: bool = False, nullable: bool = False, auto: bool = False,
         number_list: bool = False) -> Any:
    """Declare one config key: its default and the rules the loader enforces.

    ``number_list``: a ``str`` key holding comma-separated numbers that may also be
    written as a YAML list (``[32, 64]``), stored as the text ``'32,64'``.
    """
    meta = {"doc": doc, "choices": choices, "minimum": minimum, "maximum": maximum,
            "exclusive_max": exclusive_max, "nullable": nullable, "auto": auto,
            "number_list": number_list}
    if isinstance(default, dict):  # a mapping of named sub-sections, empty by default
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


MODEL_NAMES = ("cosmoflow", "cosmoflow-mlperf", "resnet3d", "tiny")


@dataclass
class ModelConfig:
    name: str = spec("cosmoflow", "network to train", choices=MODEL_NAMES)
    width: int = spec(128, "input cube width W (the input is channels x W^3)", minimum=4)
    channels: int = spec(4, "input channels (CosmoFlow: 4 redshift snapshots)", minimum=1)
    outputs: int = spec(4, "regression targets (CosmoFlow: 4 cosmological parameters)", minimum=1)
    dropout: float = spec(0.0, "dropout probability before each linear layer",
                          minimum=0.0, maximum=1.0, exclusive_max=True)
    batchnorm: bool = spec(False, "batch normalisation after each convolution")
    leaky_slope: float | None = spec(None, "LeakyReLU negative slope; null = the model's own "
                                     "(cosmoflow 0.01 as in the paper, cosmoflow-mlperf 0.3, "
                                     "tiny 0.01; resnet3d uses ReLU)",
                                     minimum=0.0, maximum=1.0, nullable=True)
    block: str = spec("basic", "resnet3d residual block type", choices=("basic", "bottleneck"))
    depth: int = spec(18, "resnet3d depth", choices=(10, 18, 34, 50, 101))
    base_channels: int = spec(16, "resnet3d channels of the first stage", minimum=1)


@dataclass
class SyntheticConfig:
    samples: int = spec(64, "samples generated when data.source is synthetic", minimum=2)
    seed: int = spec(1, "seed of the synthetic universes", minimum=0)
    val_fraction: float = spec(0.125, "fraction of synthetic samples held out for validation",
                               minimum=0.0, maximum=1.0, exclusive_max=True)


@dataclass
class DataConfig:
    source: str = spec("files", "where samples come from: a dataset directory (files) or the "
                       "built-in generator (synthetic, written under output.dir/data)",
                       choices=("files", "synthetic"))
    path: str | None = spec(None, "dataset directory (with manifest.json) when source is files",
                            nullable=True)
    format: str = spec("auto", "sample file format: auto (from the files: *.hdf5 / *.h5, "
                       "*.tfrecord plain or gzip, NVIDIA *_data.npy), or one of them forced "
                       "(a directory holding two formats needs it)",
                       choices=("auto", "hdf5", "tfrecord", "npy"))
    reader: str = spec("preload", "preload (dataset held in the job's memory) or direct "
                       "(each rank reads its sub-volume every step)",
                       choices=("preload", "direct"))
    transform: str = spec("log1p", "input transform: log(1+x), divide by the mean, or none",
                          choices=("log1p", "mean", "none"))
    shuffle: str = spec("global", "global: one permutation of the split per epoch, the same "
                        "at any rank count; local: each sample group keeps a fixed shard and "
                        "shuffles within it (MLPerf; stages only a node's shards)",
                        choices=("global", "local"))
    drop_last: bool = spec(False, "drop the last, smaller batch of each epoch")
    prefetch: bool = spec(True, "direct reader: read the next batch in a background thread "
                          "while the step computes")
    memory_fraction: float = spec(0.8, "preload reader: share of each node's available "
                                  "memory (MemAvailable) the preloaded dataset may fill",
                                  minimum=0.0, maximum=1.0)
    stage_dir: str | None = spec(None, "where cosmotrain preload copies the dataset on each "
                                 "node; null = $TMPDIR/cosmotrain/<dataset name>",
                                 nullable=True)
    cache_dir: str | None = spec(None, "manifest and label caches of read-only datasets; "
                                 "null = $COSMOTRAIN_CACHE_DIR or ~/.cache/cosmotrain",
                                 nullable=True)
    verify: str = spec("auto", "check each file against the CRC-32C its manifest records "
                       "when a job opens the dataset: auto (when recorded: staged, converted "
                       "or generated data), always (refuse a dataset without checksums) or "
                       "never", choices=("auto", "always", "never"))
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class LayerParallelConfig:
    algorithm: str | None = spec(None, "this convolution's channel/filter algorithm; null = "
                                 "parallel.channel_algorithm", choices=("x", "y", "w", AUTO),
                                 nullable=True)
    channel: int | None = spec(None, "stationary-w only: ways this layer splits its input "
                               "channels (the filters take the rest of the channel x filter "
                               "ranks); null = parallel.channel", minimum=1, nullable=True)


@dataclass
class ParallelConfig:
    sample: int | str = spec(AUTO, "sample groups (data parallelism); auto takes the ranks "
                             "left over by the other dimensions", minimum=1, auto=True)
    channel: int = spec(1, "ways input channels of convolutions are split", minimum=1)
    filter: int = spec(1, "ways filters (output channels) of convolutions are split", minimum=1)
    channel_algorithm: str = spec(AUTO, "how convolutions use the channel x filter ranks: "
                                  "x (stationary-x: weights split by input channel), y "
                                  "(stationary-y: by filter), w (stationary-w: both, on the "
                                  "channel x filter grid); auto = least communication per "
                                  "layer (docs/PARALLELISM.md)", choices=("x", "y", "w", AUTO))
    layers: dict[str, LayerParallelConfig] = spec(
        {}, "per-convolution overrides by dotted layer name, e.g. {conv1: {algorithm: y}}")
    depth: int = spec(1, "ways the depth (D) dimension is split", minimum=1)
    height: int = spec(1, "ways the height (H) dimension is split", minimum=1)
    width: int = spec(1, "ways the width (W) dimension is split", minimum=1)
    spatial_until: str = spec(AUTO, "first top-level layer that runs on whole samples (after "
                              "an all-to-all); auto: the first layer that cannot run on "
                              "blocks or whose blocks are thinner than 4 planes")
    bn_statistics: str = spec("global", "batch-norm statistics over the whole mini-batch "
                              "(global, the 1-rank function) or one sample group's share "
                              "(local)", choices=("global", "local"))
    bucket_mb: float = spec(25.0, "size of the gradient allreduce buckets (MiB)",
                            minimum=0.0)
    shard_optimizer: bool = spec(False, "ZeRO-style sharding: each rank keeps the optimizer "
                                 "state (momentum, Adam moments) of only its 1/R of the "
                                 "parameters its R replicas share, gradients are "
                                 "reduce-scattered and the updated parameters all-gathered "
                                 "(docs/PARALLELISM.md): the unsharded results, to float "
                                 "rounding, with less memory per rank")
    auto: bool = spec(False, "let the planner choose sample, channel, filter, depth, height, "
                      "width and the channel algorithm at start-up (cosmotrain plan); "
                      "`parallel: auto` is short for `parallel: {auto: true}`")
    machine: str | None = spec(None, "machine model for auto: a file from cosmotrain "
                               "calibrate or a preset (v100-abci, a100, h100); default: the "
                               "calibrated file", nullable=True)


@dataclass
class TrainConfig:
    batch_size: int = spec(4, "global mini-batch size (split over the sample groups)", minimum=1)
    epochs: int = spec(1, "passes over the training set", minimum=1)
    max_steps: int | None = spec(None, "stop after this many steps (overrides epochs when "
                                 "reached first)", minimum=1, nullable=True)
    seed: int = spec(0, "seed of initialisation, data order and dropout", minimum=0)
    validate_every: int = spec(1, "validate (MSE, MAE per target) every N epochs; 0 = never",
                               minimum=0)
    target_mae: float | None = spec(None, "stop early once the validation MAE (mean over "
                                    "the targets) is at most this", minimum=0.0,
                                    nullable=True)
    checkpoint_every_epochs: int = spec(1, "write a checkpoint every N epochs (and at the "
                                        "end); 0 = only at the end", minimum=0)
    checkpoint_every_steps: int | None = spec(None, "also write a checkpoint every N steps",
                                              minimum=1, nullable=True)
    keep_checkpoints: int = spec(3, "checkpoints kept under output.dir/checkpoints (the "
                                 "newest)", minimum=1)
    log_every: int = spec(1, "write a metrics record every N steps", minimum=1)
    watchdog_s: float | None = spec(300.0, "end the job when a rank makes no progress for "
                                    "this many seconds (at least 10x the slowest step "
                                    "seen), naming the rank and host; null = no watchdog",
                                    minimum=1.0, nullable=True)


SCHEDULE_NAMES = ("constant", "step", "cosine")


@dataclass
class ScheduleConfig:
    """The learning rate over training (``cosmotrain.engine.schedule``; formulas there)."""

    name: str = spec("constant", "learning-rate schedule after the warm-up: constant "
                     "(optimizer.lr), step (optimizer.lr x decay_factors from decay_epochs on, "
                     "as MLPerf CosmoFlow) or cosine (down to min_lr at train.epochs)",
                     choices=SCHEDULE_NAMES)
    warmup_epochs: float = spec(0.0, "epochs of linear warm-up from warmup_start_lr to "
                                "optimizer.lr, per step (MLPerf CosmoFlow: 4)", minimum=0.0)
    warmup_start_lr: float = spec(0.0, "learning rate at the first step of the warm-up",
                                  minimum=0.0)
    decay_epochs: str = spec("", "step schedule: increasing epochs at which the rate drops, "
                             "a list or comma-separated, e.g. [32, 64] or '32,64' (MLPerf "
                             "CosmoFlow)", number_list=True)
    decay_factors: str = spec("", "step schedule: factors of optimizer.lr, one per decay "
                              "epoch, not cumulative, a list or comma-separated, e.g. "
                              "[0.25, 0.125] (MLPerf)", number_list=True)
    min_lr: float = spec(0.0, "cosine schedule: the rate reached at the end of train.epochs",
                         minimum=0.0)


@dataclass
class OptimizerConfig:
    name: str = spec("adam", "optimizer", choices=("adam", "sgd"))
    lr: float = spec(1e-3, "learning rate", minimum=0.0)
    momentum: float = spec(0.9, "SGD momentum", minimum=0.0, maximum=1.0, exclusive_max=True)
    weight_decay: float = spec(0.0, "L2 weight decay", minimum=0.0)
    beta1: float = spec(0.9, "Adam beta1", minimum=0.0, maximum=1.0, exclusive_max=True)
    beta2: float = spec(0.999, "Adam beta2", minimum=0.0, maximum=1.0, exclusive_max=True)
    eps: float = spec(1e-8, "Adam epsilon", minimum=0.0)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


MLPERF_DIVISIONS = ("closed", "open")
MLPERF_STATUSES = ("onprem", "cloud", "preview", "research")


@dataclass
class MLPerfConfig:
    """The submission fields of ``<output.dir>/mlperf.log`` (docs/OBSERVABILITY.md)."""

    org: str = spec("unknown", "MLPerf submission_org: the submitting organisation")
    division: str = spec("closed", "MLPerf submission_division (closed: the reference "
                         "model, cosmoflow-mlperf, and optimizer, sgd)",
                         choices=MLPERF_DIVISIONS)
    status: str = spec("onprem", "MLPerf submission_status", choices=MLPERF_STATUSES)
    platform: str | None = spec(None, "MLPerf submission_platform: the system's name; null "
                                "= '<nodes>x<host name of rank 0>'", nullable=True)


@dataclass
class OutputConfig:
    dir: str = spec("runs/default", "output directory (resolved config, metrics, checkpoints)")
    tensorboard: bool = spec(False, "TensorBoard event files under output.dir/tensorboard "
                             "(loss, lr, throughput, time breakdown, memory, validation; "
                             "rank 0; needs the tensorboard extra)")
    mlperf_log: bool = spec(False, "MLPerf HPC v3.0 CosmoFlow compliance log "
                            "output.dir/mlperf.log (:::MLLOG lines, rank 0; cosmotrain "
                            "preload adds its staging lines); needs the mlperf extra")
    mlperf: MLPerfConfig = field(default_factory=MLPerfConfig)


BACKENDS = (AUTO, "cpu", "gpu")
PRECISIONS = ("fp32", "tf32", "bf16")
CONV_ALGORITHMS = (AUTO, "cudnn", "gemm")
CONV1_ALGORITHMS = ("default", "direct")
COMMUNICATIONS = ("staging", "cuda-aware", "nccl")


@dataclass
class DeviceConfig:
    """Where the network runs and in which precision (``cosmotrain.device``, docs/GPU.md)."""

    backend: str = spec(AUTO, "cpu (numpy), gpu (cupy) or auto: gpu when cupy imports and a "
                        "CUDA device is visible on every rank, else cpu; `backend: gpu` at "
                        "the top level is short for `device: {backend: gpu}`",
                        choices=BACKENDS)
    precision: str = spec("fp32", "fp32; tf32 (GPU only: TF32 tensor-core math on fp32 "
                          "storage); bf16 (activations and gradients stored as bfloat16, "
                          "fp32 accumulation and fp32 master weights; on the cpu backend a "
                          "slow validation emulation)", choices=PRECISIONS)
    conv_algorithm: str = spec(AUTO, "GPU convolutions: cudnn, gemm (im2col + cuBLAS) or "
                               "auto (cudnn when available)", choices=CONV_ALGORITHMS)
    cudnn_autotune: bool = spec(False, "GPU: time every cuDNN plan of each convolution "
                                "at its first call and keep the fastest (PyTorch's "
                                "cudnn.benchmark); false: cuDNN's heuristic choice")
    conv1_channels_pad: int = spec(0, "GPU: pad the input channels of a convolution whose "
                                   "count is not a multiple of this with zero channels up "
                                   "to one (8: conv1's 4 channels for cuDNN's tensor-core "
                                   "engines; the same function); 0: never",
                                   minimum=0, maximum=64)
    conv1_algorithm: str = spec("default", "GPU: conv1 (at most 8 input channels, "
                                "stride 1): direct (our kernels: the forward with its "
                                "bias and LeakyReLU fused, the weight gradient) or "
                                "default (as device.conv_algorithm)",
                                choices=CONV1_ALGORITHMS)
    communication: str = spec("staging", "how GPU buffers cross MPI: staging (through "
                              "pinned host memory; any MPI), cuda-aware (device pointers "
                              "to an MPI built with CUDA support) or nccl (NCCL "
                              "collectives and send/recv; one GPU per rank)",
                              choices=COMMUNICATIONS)
    gpus_per_node: int | str = spec(AUTO, "GPUs of a node the ranks are bound to (local "
                                    "rank modulo this); auto = every visible device "
                                    "(CUDA_VISIBLE_DEVICES honoured)", minimum=1, auto=True)
    reuse_freed_memory: bool = spec(True, "keep freed host memory in the process's heap "
                                    "(glibc) so that each step reuses the pages of the "
                                    "last instead of faulting fresh ones in (about 20% of "
                                    "a CPU step at W=128); the process then stays at its "
                                    "peak between steps. false: glibc's default")
    cuda_graph: bool | str = spec(AUTO, "GPU: capture the steady-state training step once "
                                  "as a CUDA graph and replay it (no per-kernel launch "
                                  "cost); auto captures where the step can be captured "
                                  "and logs why not otherwise; true fails at start-up "
                                  "naming what prevents it (docs/GPU.md, 'CUDA graph')",
                                  auto=True)
    cuda_graph_warmup: int = spec(3, "GPU: eager steps before the capture (the first "
                                  "creates the optimizer's slots, cuDNN plans are tuned "
                                  "on their first call)", minimum=2)
    plan_step_memory: bool = spec(True, "with reuse_freed_memory: place the large host "
                                  "arrays (1 MiB and up) of every training and "
                                  "validation step at the offsets planned from the step "
                                  "before, in one arena, so that the kept memory holds "
                                  "no holes (W=256, D2H2: 867 MiB a rank, 1015-1205 on "
                                  "the heap alone). false: the heap places them")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
