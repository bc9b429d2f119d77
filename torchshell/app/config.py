"""The run's configuration: dataclass schemas, their cross-field checks, and composition.

Hydra composes ``conf/`` against the schemas (a typo or a wrong type fails before any work);
:func:`typed` turns the result into the :class:`Config` dataclass once, at the edge, and
checks what one field alone cannot say (a loss that exists, a data/model pair of one recipe,
step counts that are multiples of ``steps_per_call``). Everything past it takes plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

import jaxcore
from torchshell._errors import ConfigError

#: The losses ``model.loss`` may name. Add yours here (a ``(outputs, batch) -> (loss,
#: metrics)`` function, see :func:`jaxcore.softmax_cross_entropy`).
LOSSES: dict[str, Callable[..., Any]] = {"softmax_cross_entropy": jaxcore.softmax_cross_entropy}


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
    compile_cache_dir: str | None = "~/.cache/coreshell/jax"
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
    prometheus_port: int | None = None  # a /metrics endpoint on process 0 (0: a free port)
    prometheus_host: str = "127.0.0.1"
    close_timeout_s: float = 60.0  # at the end, wait this long for a store that is down


@dataclass
class CkptConfig:
    """Orbax checkpoints of the JAX state with Lightning's loop state, every N steps, in
    ``root/RECIPE-MODEL/RUN`` (each run its own folder), or in ``dir`` when it is set."""

    root: str = "checkpoints"
    dir: str | None = None
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
    reads; ``loss`` a name in :data:`LOSSES`. ``recipe`` names the recipe the model belongs
    to: when ``data.recipe`` is set too, the two must agree.
    ``device_front_end`` (``{flax, twin, inputs}``) replaces those three when
    ``data.front_end`` resolves to ``device`` (:func:`use_front_end`).
    """

    flax: Any = None
    twin: Any = None
    torch: Any = None
    # a LightningModule to port as it is (JaxModule.from_lightning): set its `_target_`
    lightning: Any = field(default_factory=lambda: {"_target_": None})

    @property
    def lightning_module(self) -> Any:
        """The ``lightning`` config when it names a class, else ``None``."""
        node = self.lightning
        return node if node is not None and node.get("_target_") else None

    inputs: list[str] = field(default_factory=lambda: ["x"])
    loss: str = "softmax_cross_entropy"
    recipe: str | None = None
    # with data.front_end resolving to `device`: the {flax, twin, inputs} that replace the
    # ones above (a model fed raw waveforms that computes its features in the jitted step)
    device_front_end: Any = None


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

    def check(self) -> None:
        """The cross-field checks: raises :class:`ConfigError` naming the fields and the fix.

        Example:
            >>> ok = Config(data={}, model=ModelConfig(torch={"_target_": "torch.nn.Linear"}))
            >>> ok.check()
            >>> ok.model.loss = "masked_mean"; ok.check()
            Traceback (most recent call last):
            torchshell._errors.ConfigError: model.loss='masked_mean' is not a known loss; ...
        """
        k = self.step.steps_per_call
        if k > 1:
            for name, value in (
                ("trainer.max_steps", self.trainer.max_steps),
                ("trainer.log_every_n_steps", self.trainer.log_every_n_steps),
                ("ckpt.every_n_steps", self.ckpt.every_n_steps),
            ):
                if value > 0 and value % k:
                    raise ConfigError(
                        f"{name}={value} is not a multiple of step.steps_per_call={k}. "
                        f"Fix: make it a multiple of {k}."
                    )
        if self.model.loss not in LOSSES:
            raise ConfigError(
                f"model.loss={self.model.loss!r} is not a known loss; expected one of "
                f"{sorted(LOSSES)}. Fix: set model.loss to one of them, or add yours to "
                "torchshell.app.config.LOSSES."
            )
        whole = self.model.torch is not None or self.model.lightning_module is not None
        if not whole and (self.model.flax is None or self.model.twin is None):
            raise ConfigError(
                "model needs `lightning` (a LightningModule), `torch` (an nn.Module to trace) "
                "or both `flax` and `twin`; "
                f"got flax={self.model.flax}, twin={self.model.twin}. Fix: pick a model config "
                "(model=digits, model=torch_mlp, ...) or set those keys."
            )


def check_recipe(cfg: DictConfig) -> None:
    """Refuses a data config and a model config of two different recipes, before resolving.

    Runs on the composed, unresolved config: a model of another recipe usually
    interpolates keys that this data config lacks (``${data.n_mels}``).

    Example:
        >>> check_recipe(OmegaConf.create({"data": {"recipe": "digits"},
        ...                                "model": {"recipe": "spoken_digits"}}))
        Traceback (most recent call last):
        torchshell._errors.ConfigError: data=digits and model=spoken_digits ...
    """
    data = OmegaConf.select(cfg, "data.recipe", default=None)
    model = OmegaConf.select(cfg, "model.recipe", default=None)
    if data is not None and model is not None and data != model:
        raise ConfigError(
            f"data={data} and model={model} are parts of two different recipes (a model "
            f"reads the fields of its own data). Fix: pick one recipe, recipe={data} (or "
            f"data={data} alone: the model follows the data), or set model={data}."
        )


def typed(cfg: DictConfig) -> Config:
    """The composed config as a :class:`Config`, checked (the one conversion at the edge).

    Example:
        >>> typed(compose_config(["data=digits"])).model.inputs
        ['x']
    """
    from omegaconf.errors import OmegaConfBaseException

    check_recipe(cfg)
    try:
        config = cast(Config, OmegaConf.to_object(cfg))
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"The config does not resolve: {err}. Fix: check the keys it names (coreshell "
            "train --cfg job prints the composed config); a data config and a model of one "
            "recipe go together (recipe=NAME)."
        ) from err
    use_front_end(config)
    config.check()
    return config


def use_front_end(config: Config) -> None:
    """Resolves ``data.front_end`` (``auto``: ``device`` on an accelerator) and, for
    ``device``, swaps in the model's ``device_front_end`` (its ``flax``, ``twin``, ``inputs``).

    A data config without ``front_end`` is left alone.

    Example:
        >>> cfg = typed(compose_config(["data.front_end=device"]))
        >>> cfg.data["front_end"], cfg.model.inputs
        ('device', ['waveform', 'lengths'])
    """
    data = config.data
    if not isinstance(data, dict) or data.get("front_end") is None:
        return
    from torchshell.data._front_end import resolve_front_end

    try:
        data["front_end"] = chosen = resolve_front_end(str(data["front_end"]))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if chosen != "device":
        return
    alt = config.model.device_front_end
    if not alt:
        raise ConfigError(
            "data.front_end=device, but the model has no device_front_end (a model fed raw "
            "waveforms). Fix: set data.front_end=host, or give the model config a "
            "device_front_end with flax, twin and inputs (conf/model/spoken_digits.yaml)."
        )
    model = config.model
    model.flax = alt.get("flax", model.flax)
    model.twin = alt.get("twin", model.twin)
    model.inputs = list(alt.get("inputs", model.inputs))
    buckets = list(data.get("buckets") or [])
    crops = {  # null crops: the data set's own (its training crop, its last bucket)
        "train_frames": data.get("train_frames") or (buckets[-1] if buckets else None),
        "eval_frames": buckets[-1] if buckets else None,
    }
    for part in (model.flax, model.twin):
        for key, value in crops.items():
            if isinstance(part, dict) and key in part and part[key] is None:
                if value is None:
                    raise ConfigError(
                        f"model.device_front_end's {key} is null and data has no buckets to "
                        f"take it from. Fix: set model.device_front_end.flax.{key} (and twin's)."
                    )
                part[key] = int(value)


def plain(node: Any) -> Any:
    """A config node as plain Python values: dataclasses and DictConfigs become dicts.

    Example:
        >>> plain(OptimConfig())["name"]
        'adamw'
    """
    return OmegaConf.to_container(OmegaConf.create(node), resolve=True)


def config_dir() -> Path:
    """The Hydra config tree: ``torchshell/conf`` in a wheel, ``conf/`` in a checkout.

    Example:
        >>> (config_dir() / "config.yaml").is_file()
        True
    """
    package = Path(__file__).resolve().parents[1]  # torchshell/
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise ConfigError(
        f"No config.yaml under {package / 'conf'} or {package.parent / 'conf'}: "
        "the install is incomplete. Fix: reinstall coreshell."
    )


def register_configs() -> None:
    """Registers the schemas with Hydra's ConfigStore (called by the CLI, not at import).

    Example:
        >>> register_configs()
    """
    cs = ConfigStore.instance()
    cs.store(name="coreshell_schema", node=Config)


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``coreshell train OVERRIDES`` would run with (Hydra's compose API).

    Example:
        >>> compose_config(["optim.lr=0.01"]).optim.lr
        0.01
    """
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))
