"""Dataclass schemas of the Hydra config: a typo or a wrong type fails before any work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class OptimConfig:
    """Arguments of :func:`jaxcore.make_optimizer`."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    momentum: float = 0.9
    clip_norm: float | None = None
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0


@dataclass
class MeshConfig:
    """Mesh axes (``-1`` fills with the remaining devices) and how params are sharded.

    ``preset`` is one of ``jaxcore.PRESETS`` (dp, fsdp, tp, fsdp_tp); ``rules`` are tried
    first, as ``[[regex, [axis_or_null, ...]], ...]`` over '/'-joined param paths.
    ``cpu_devices`` splits the host CPU into JAX devices before JAX starts
    (``jaxcore.set_cpu_devices``): ``auto`` (one per core), a count, or null (JAX's default).
    """

    axes: dict[str, int] = field(default_factory=lambda: {"data": -1, "model": 1})
    preset: str = "dp"
    rules: list[Any] = field(default_factory=list)
    data_axis: str = "data"
    model_axis: str = "model"
    num_devices: int | None = None
    cpu_devices: Any = None  # "auto", an int or None


@dataclass
class PrecisionConfig:
    """Compute dtype of the step (params, grads, optimizer state and loss stay float32)."""

    compute_dtype: str = "float32"


@dataclass
class StepConfig:
    """How the jitted train step runs (arguments of ``JaxModule``)."""

    steps_per_call: int = 1
    accum_steps: int = 1
    nan_policy: str = "stop"
    compile_cache_dir: str | None = None
    dump_hlo: bool = True


@dataclass
class TrainerConfig:
    """Arguments of ``lightning.Trainer``, with Lightning's own names."""

    max_steps: int = -1
    max_epochs: int | None = None
    log_every_n_steps: int = 50
    val_check_interval: Any = None
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    deterministic: bool = False


@dataclass
class TrackingConfig:
    """Where the run is tracked: MLflow's local SQLite store by default."""

    uri: str = "sqlite:///mlflow.db"
    experiment: str = "coreshell"
    run_name: str | None = None
    register_as: str | None = None
    system_metrics_interval_s: float | None = 10.0


@dataclass
class CkptConfig:
    """Orbax checkpoints of the JAX state with Lightning's loop state, every N steps."""

    dir: str = "checkpoints/${tracking.experiment}"
    every_n_steps: int = 200
    keep: int = 2


@dataclass
class DistConfig:
    """JAX's multi-process runtime (see ``torchshell.distributed.initialize``).

    Nothing set: one process. ``auto: true`` detects SLURM, Open MPI or Kubernetes; or pass
    ``coordinator`` (process 0's ``HOST:PORT``), ``num_processes`` and ``process_id`` on every
    process (``coreshell launch --nproc N`` does that on one machine).
    """

    auto: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = None
    bind_address: str | None = None
    heartbeat_timeout_s: int = 30
    init_timeout_s: int = 300


@dataclass
class ModelConfig:
    """The model: a Flax module with its torch twin (export target), or a torch module.

    With ``torch`` set (an ``nn.Module`` to instantiate), the module is traced by torchax and
    trained as it is; ``flax`` and ``twin`` stay null. ``inputs`` are the batch keys the model
    reads; ``loss`` a function of :mod:`jaxcore.losses`.
    """

    flax: Any = None
    twin: Any = None
    torch: Any = None
    inputs: list[str] = field(default_factory=lambda: ["x"])
    loss: str = "softmax_cross_entropy"


@dataclass
class Config:
    """The whole run."""

    data: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    step: StepConfig = field(default_factory=StepConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    resume: str | None = None
    seed: int = 0
    test_after_fit: bool = True


def register_configs() -> None:
    """Registers the schemas with Hydra's ConfigStore (called by the CLI, not at import)."""
    cs = ConfigStore.instance()
    cs.store(name="coreshell_schema", node=Config)
