"""The ``coreshell`` command: ``coreshell train [hydra overrides]``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import lightning as L
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

import jaxcore
from jaxcore import losses
from torchshell import distributed
from torchshell._errors import CheckpointError, ConfigError
from torchshell.checkpoint import (
    CheckpointOnSigterm,
    OrbaxCheckpointIO,
    latest_checkpoint,
    verify,
)
from torchshell.config import register_configs
from torchshell.doctor import doctor_command
from torchshell.export import export_command, export_module
from torchshell.launch import launch_command
from torchshell.module import JaxModule
from torchshell.publish import publish, test_predictions
from torchshell.tracking import AsyncMLflowLogger, SystemMetrics, run_tags

USAGE = """usage: coreshell train [OVERRIDES...]
       coreshell launch --nproc N [--devices-per-proc K] -- train [OVERRIDES...]

  train    train with the Hydra config in conf/ (e.g. trainer.max_steps=200 optim.lr=1e-3)
           add --cfg job to print the resolved config, -m for a multirun sweep
  launch   run `train` in N local processes on JAX's distributed runtime
"""


def config_dir() -> Path:
    """The Hydra config tree: ``torchshell/conf`` in a wheel, ``conf/`` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"No config.yaml under {here / 'conf'} or {here.parent / 'conf'}: "
        "the install is incomplete. Fix: reinstall coreshell."
    )


def _flatten(cfg: DictConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def _loss(name: str) -> Any:
    fn = getattr(losses, name, None)
    if not callable(fn):
        known = [n for n in dir(losses) if not n.startswith("_") and n != "annotations"]
        raise ValueError(
            f"Unknown loss {name!r}; expected one of {known}. Fix: set model.loss to one of them."
        )
    return fn


def build(cfg: DictConfig) -> tuple[L.LightningDataModule, JaxModule, torch.nn.Module]:
    """The data module, the :class:`JaxModule` and the torch model to export into.

    With ``steps_per_call=K`` the training DataLoader carries ``K * data.batch_size`` rows
    per batch (``JaxModule`` views them as K stacked batches). ``data.batch_size`` is the
    global batch: with several JAX processes each loader yields its share of the rows.
    """
    k = cfg.step.steps_per_call
    rows = distributed.local_batch_size(cfg.data.batch_size) * k
    data = instantiate(cfg.data, seed=cfg.seed, batch_size=rows)
    mesh = jaxcore.make_mesh(dict(cfg.mesh.axes), num_devices=cfg.mesh.num_devices)
    options = dict(
        mesh=mesh,
        inputs=list(cfg.model.inputs),
        seed=cfg.seed,
        sharding=cfg.mesh.preset,
        rules=OmegaConf.to_container(cfg.mesh.rules),
        data_axis=cfg.mesh.data_axis,
        model_axis=cfg.mesh.model_axis,
        steps_per_call=k,
        accum_steps=cfg.step.accum_steps,
        compute_dtype=cfg.precision.compute_dtype,
        nan_policy=cfg.step.nan_policy,
        print_summary=cfg.trainer.enable_model_summary and distributed.is_main(),
    )
    loss = _loss(cfg.model.loss)
    tx = jaxcore.make_optimizer(**cast(dict[str, Any], OmegaConf.to_container(cfg.optim)))
    if cfg.model.torch is not None:
        torch.manual_seed(cfg.seed)  # the module's initial weights come from torch's RNG
        net = instantiate(cfg.model.torch, _convert_="all")
        return data, JaxModule.from_torch(net, loss, tx, **options), net
    if cfg.model.flax is None or cfg.model.twin is None:
        raise ConfigError(
            "model needs either `torch` (an nn.Module to trace) or both `flax` and `twin`; "
            f"got flax={cfg.model.flax}, twin={cfg.model.twin}. Fix: pick a model config "
            "(model=digits, model=torch_mlp, ...) or set those keys."
        )
    flax_model = instantiate(cfg.model.flax, _convert_="all")
    twin = instantiate(cfg.model.twin, _convert_="all")
    return data, JaxModule(flax_model, loss, tx, **options), twin


def _export_hook(cfg: DictConfig, module: JaxModule, twin: torch.nn.Module) -> Any:
    """Writes the torch weights and the config beside a checkpoint."""

    def on_save(directory: Path) -> None:
        if not distributed.is_main():  # the same gathers (collectives) as process 0's export
            module.torch_state_dict(twin)
            return
        export_module(module, twin, directory / "export" / "model.safetensors")
        OmegaConf.save(cfg, directory / "config.yaml")

    return on_save


def _resume_path(cfg: DictConfig) -> str | None:
    if cfg.resume in (None, "", "null"):
        return None
    if cfg.resume == "last":
        found = latest_checkpoint(cfg.ckpt.dir)
        if found is None:
            print(
                f"coreshell: resume=last but no intact checkpoint in {cfg.ckpt.dir}: "
                "starting a new run."
            )
        return None if found is None else str(found)
    problem = verify(Path(cfg.resume))
    if problem is not None:
        raise CheckpointError(
            f"resume={cfg.resume} is not an intact checkpoint: {problem}. Fix: pass a "
            f"checkpoint directory, or resume=last to take the newest intact one in "
            f"ckpt.dir ({cfg.ckpt.dir})."
        )
    return str(cfg.resume)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Runs one training job from a resolved config; returns the run's summary.

    Args:
        cfg: the composed Hydra config (see ``conf/config.yaml``).

    Returns:
        ``{"run_id", "tracking_uri", "export", "parity_max_abs_diff", "metrics"}``.
    """
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save INFO lines
    jaxcore.set_cpu_devices(cfg.mesh.cpu_devices)  # before JAX starts
    distributed.initialize(**cast(dict[str, Any], OmegaConf.to_container(cfg.dist)))
    # after initialize (JAX touches no device before); process 0 logs, prints and exports
    main = distributed.is_main()
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if main:  # the run directory is complete for `coreshell export RUN_DIR`
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out_dir / "config.yaml")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.step.compile_cache_dir:
        jaxcore.enable_compile_cache(cfg.step.compile_cache_dir)
    k = cfg.step.steps_per_call
    for name in ("max_steps", "log_every_n_steps"):
        value = cfg.trainer[name]
        if k > 1 and value > 0 and value % k:
            raise ConfigError(
                f"trainer.{name}={value} is not a multiple of "
                f"step.steps_per_call={k}. Fix: make it a multiple of {k}."
            )
    if k > 1 and cfg.ckpt.every_n_steps % k:
        raise ConfigError(
            f"ckpt.every_n_steps={cfg.ckpt.every_n_steps} is not a multiple of "
            f"step.steps_per_call={k}. Fix: make it a multiple of {k}."
        )
    data, module, twin = build(cfg)
    if cfg.step.dump_hlo and main:
        module.hlo_dump_dir = out_dir / "hlo"
    ckpt_path = _resume_path(cfg)
    logger = None
    if main:
        logger = AsyncMLflowLogger(
            cfg.tracking.experiment,
            tracking_uri=cfg.tracking.uri,
            run_name=cfg.tracking.run_name,
            tags=run_tags(module.mesh),
            spill_dir=out_dir / "tracking",
        )
        logger.log_config(cfg)
    interval = cfg.tracking.system_metrics_interval_s
    system = SystemMetrics(logger, interval_s=interval) if logger and interval else None
    trainer, sigterm = _make_trainer(cfg, module, twin, logger, out_dir, main)
    status = "FAILED"
    try:
        try:
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        except SIGTERMException:
            status = "KILLED"
            print(
                f"coreshell: SIGTERM received; saved checkpoint {sigterm.saved}. "
                f"Continue with: coreshell train resume=last ckpt.dir={cfg.ckpt.dir}"
            )
            raise SystemExit(0) from None
        except jaxcore.NonFiniteError as err:
            print(
                f"coreshell: stopped: {err}\nThe newest checkpoint in {cfg.ckpt.dir} holds "
                "the last good state.",
                file=sys.stderr,
            )
            raise SystemExit(1) from None
        metrics = {k: float(np.asarray(v)) for k, v in trainer.callback_metrics.items()}
        if cfg.test_after_fit:
            trainer.test(module, datamodule=data, verbose=False)
            metrics |= {k: float(np.asarray(v)) for k, v in trainer.callback_metrics.items()}
        if module.state is None:
            raise ConfigError(
                "Training ran no step, so there is nothing to export. Fix: check "
                "trainer.max_steps/limit_train_batches and that the data set is "
                "not empty."
            )
        if logger is None:
            return _follow_main(cfg, data, module, twin, metrics)
        result = publish(
            logger,
            module,
            twin,
            data,
            out_dir,
            inputs=list(cfg.model.inputs),
            register_as=cfg.tracking.register_as,
            step=trainer.global_step,
        )
        status = "FINISHED"
    finally:
        if system is not None:
            system.stop()
        report = logger.close(status) if logger is not None else None
    assert report is not None
    print(
        f"\nMLflow run {report.run_id} in {cfg.tracking.uri} "
        f"(experiment {cfg.tracking.experiment!r}): {report}"
    )
    print(
        "  metrics: "
        + ", ".join(
            f"{k}={v:.4f}"
            for k, v in sorted(metrics.items())
            if "/" in k and not k.startswith("bridge/")
        )
    )
    print(
        f"  torch weights: {result['export']} "
        f"(parity max abs diff {result['parity_max_abs_diff']:.2e})"
    )
    if cfg.tracking.uri.startswith("sqlite:"):
        print(f"  open it with: mlflow ui --backend-store-uri {cfg.tracking.uri}")
    return {"run_id": report.run_id, "tracking_uri": cfg.tracking.uri, "metrics": metrics, **result}


def _make_trainer(
    cfg: DictConfig,
    module: JaxModule,
    twin: torch.nn.Module,
    logger: Any,
    out_dir: Path,
    main: bool,
) -> tuple[L.Trainer, CheckpointOnSigterm]:
    """The real ``lightning.Trainer`` with Orbax checkpoints on the configured schedule."""
    checkpointing = cfg.ckpt.every_n_steps > 0
    sigterm = CheckpointOnSigterm(cfg.ckpt.dir)
    callbacks: list[L.Callback] = [sigterm]
    if checkpointing:
        callbacks.append(
            ModelCheckpoint(
                dirpath=cfg.ckpt.dir,
                monitor="step",
                mode="max",
                save_top_k=cfg.ckpt.keep,
                every_n_train_steps=cfg.ckpt.every_n_steps,
            )
        )
    ckpt_io = OrbaxCheckpointIO(
        lambda: module.state, module.restore_from, _export_hook(cfg, module, twin)
    )
    trainer_args = {
        **cast(dict[str, Any], OmegaConf.to_container(cfg.trainer)),
        "enable_model_summary": False,
        "enable_progress_bar": cfg.trainer.enable_progress_bar and main,
    }
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger or False,
        callbacks=callbacks,
        plugins=[ckpt_io],
        enable_checkpointing=checkpointing,
        default_root_dir=str(out_dir),
        **trainer_args,
    )
    return trainer, sigterm


def _follow_main(
    cfg: DictConfig, data: Any, module: JaxModule, twin: torch.nn.Module, metrics: dict[str, Any]
) -> dict[str, Any]:
    """A process > 0 after fit: joins process 0's collectives (export gather, parity
    predict) in the same order, and leaves logging and files to process 0."""
    module.torch_state_dict(twin)
    test_predictions(module, data)
    return {"run_id": None, "tracking_uri": cfg.tracking.uri, "export": None, "metrics": metrics}


def _train_main(argv: Sequence[str]) -> None:
    import hydra

    register_configs()
    sys.argv = [f"{Path(sys.argv[0]).name} train", *argv]
    hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(train)()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``coreshell`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    if command == "train":
        _train_main(rest)
    elif command == "export":
        export_command(rest)
    elif command == "launch":
        raise SystemExit(launch_command(rest))
    elif command == "doctor":
        raise SystemExit(doctor_command(rest))
    else:
        print(f"coreshell: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
