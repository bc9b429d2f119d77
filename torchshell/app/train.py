"""``coreshell train``: one training job from a typed config, and its end summary."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import OmegaConf

import bridge
import jaxcore
from torchshell import distributed
from torchshell._errors import ConfigError
from torchshell.app import console, quiet, run_dirs
from torchshell.app.config import Config, TrainerConfig, plain
from torchshell.app.prepare import Prepared, build, prepare_run
from torchshell.app.publish import predict_test_split, publish
from torchshell.app.run_dirs import resume_path
from torchshell.checkpoint import CheckpointOnSigterm, OrbaxCheckpointIO
from torchshell.data import stop_workers
from torchshell.export import export_twin
from torchshell.module import JaxModule
from torchshell.torch_model import params_to_state_dict
from torchshell.tracking import AsyncMLflowLogger, PrometheusMetrics, SystemMetrics, run_tags
from torchshell.tracking._replay import replay_pending


def _export_hook(resolved: dict[str, Any], module: JaxModule, twin: torch.nn.Module) -> Any:
    """Writes the torch weights of a saved state and the config beside a checkpoint.

    It runs in the checkpoint's commit thread on the device copy being saved (one process),
    so it reads the state it is given, never ``module.state`` (donated by the next step);
    the config's YAML is rendered once, here (rendering it took ~0.1 s per save).
    """
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(resolved))

    def export(directory: Path, state: Any) -> None:
        if not distributed.is_main():  # the same gathers (collectives) as process 0's export
            module.torch_state_dict(twin)
            return
        path = directory / "export" / "model.safetensors"
        if module.torch_module is None:
            export_twin({"params": state.params, **state.model_state}, twin, path)
        else:
            weights = params_to_state_dict(state.params, state.model_state, module.torch_module)
            bridge.save_safetensors(weights, path)
        (directory / "config.yaml").write_text(config_yaml, encoding="utf-8")

    return export


def train(cfg: Config, out_dir: Path) -> dict[str, Any]:
    """Runs one training job from a typed config; returns the run's summary.

    Args:
        cfg: the typed config (:func:`torchshell.app.config.typed`).
        out_dir: the run directory (Hydra's output directory).

    Returns:
        ``{"run_id", "tracking_uri", "export", "parity_max_abs_diff", "metrics"}``.
    """
    run = prepare_run(cfg)
    own, ckpt_path = run_dirs.choose(cfg, plain(cfg), out_dir, cfg.resume)
    cfg.ckpt.dir = own  # the run's own folder (or the resumed run's), from here on
    done = run_dirs.already_done(ckpt_path, cfg.trainer.max_steps, cfg.trainer.max_epochs)
    if done is not None:
        if run.main:
            print(
                f"coreshell train: {ckpt_path} is already at step {done} (trainer.max_steps="
                f"{cfg.trainer.max_steps}): nothing to train. Fix: trainer.max_steps="
                f"{done + cfg.trainer.max_steps} trains {cfg.trainer.max_steps} more steps."
            )
        return {"run_id": None, "tracking_uri": cfg.tracking.uri, "export": None, "metrics": {}}
    resolved = plain(cfg)
    if run.main:  # the run directory is complete for `coreshell export RUN_DIR`
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(resolved), out_dir / "config.yaml")
        console.config_line(cfg, run, resume=None if ckpt_path is None else str(ckpt_path))
    data, module, twin = build(cfg)
    if cfg.step.dump_hlo and run.main:
        module.hlo_dump_dir = out_dir / "hlo"
    logger = None
    if run.main:
        logger = AsyncMLflowLogger(
            cfg.tracking.experiment,
            tracking_uri=cfg.tracking.uri,
            run_name=cfg.tracking.run_name,
            tags=run_tags(module.mesh),
            spill_dir=out_dir / "tracking",
            close_timeout_s=cfg.tracking.close_timeout_s,
        )
        logger.log_config(resolved)
        replaying = _replay_earlier_runs(out_dir)
    interval = cfg.tracking.system_metrics_interval_s
    system = SystemMetrics(logger, interval_s=interval) if logger and interval else None
    trainer, sigterm = _make_trainer(cfg, resolved, module, twin, logger, out_dir, run.main)
    status = "FAILED"
    try:
        try:
            with quiet.resuming(None if ckpt_path is None else str(ckpt_path)):
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
        if cfg.test_after_fit and is_overridden("test_step", module):  # (a ported module
            trainer.test(module, datamodule=data, verbose=False)  # may have none)
            metrics |= {k: float(np.asarray(v)) for k, v in trainer.callback_metrics.items()}
        if module.state is None:
            raise ConfigError(
                "Training ran no step, so there is nothing to export. Fix: check "
                "trainer.max_steps/limit_train_batches and that the data set is "
                "not empty."
            )
        if logger is None:
            return _follow_main(cfg, data, module, twin, metrics)
        if run.cache is not None:
            logger.log_metrics(
                {
                    "system/coreshell.compile.cache_hits": run.cache.hits,
                    "system/coreshell.compile.cache_misses": run.cache.misses,
                },
                step=trainer.global_step,
            )
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
        if logger is not None:
            replaying.join()
        _stop_workers(trainer)
    if report is None:  # only process 0 has a logger, and it returned above otherwise
        raise RuntimeError("process 0 ended without a tracking report")
    console.end_summary(cfg, run, report, metrics, result)
    return {"run_id": report.run_id, "tracking_uri": cfg.tracking.uri, "metrics": metrics, **result}


def _replay_earlier_runs(out_dir: Path) -> threading.Thread:
    """Sends, in the background, what earlier runs beside this one could not deliver (their
    ``tracking/undelivered.jsonl``): ``RUN_DIR/../*`` and Hydra's ``outputs/DATE/TIME``."""
    base = out_dir.resolve().parent
    thread = threading.Thread(
        target=replay_pending,
        args=(base, base.parent),
        kwargs={"patterns": ("*/tracking/undelivered.jsonl", "*/*/tracking/undelivered.jsonl")},
        name="coreshell-tracking-replay",
        daemon=True,
    )
    thread.start()
    return thread


def _stop_workers(trainer: L.Trainer) -> None:
    """Joins the DataLoader workers now. ``persistent_workers`` keeps them alive after the
    last epoch; left to the interpreter's exit they were killed mid-shutdown and one printed
    the C++ abort ``terminate called without an active exception``."""
    loaders: list[Any] = []
    for name in ("train_dataloader", "val_dataloaders", "test_dataloaders"):
        try:
            value = getattr(trainer, name)
        except Exception:  # a stage that never ran has no loaders
            continue
        if isinstance(value, dict):
            value = list(value.values())
        loaders += value if isinstance(value, list | tuple) else [value]
    for loader in loaders:
        stop_workers(loader)


def _trainer_args(trainer: TrainerConfig, main: bool) -> dict[str, Any]:
    args = plain(trainer)
    args["enable_model_summary"] = False  # Lightning's sees no torch params; ours prints
    args["enable_progress_bar"] = trainer.enable_progress_bar and main
    return args


def _make_trainer(
    cfg: Config,
    resolved: dict[str, Any],
    module: JaxModule,
    twin: torch.nn.Module,
    logger: Any,
    out_dir: Path,
    main: bool,
) -> tuple[L.Trainer, CheckpointOnSigterm]:
    """The real ``lightning.Trainer`` with Orbax checkpoints on the configured schedule."""
    checkpointing = cfg.ckpt.every_n_steps > 0
    assert cfg.ckpt.dir is not None  # (run_dirs.choose set it: the run's own folder)
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
    if main and cfg.tracking.prometheus_port is not None:
        callbacks.append(
            PrometheusMetrics(
                cfg.tracking.prometheus_port,
                host=cfg.tracking.prometheus_host,
                checkpoint_dir=cfg.ckpt.dir if checkpointing else None,
            )
        )
    args = _trainer_args(cfg.trainer, main)
    if args["enable_progress_bar"]:
        callbacks.append(console.progress_bar())
    ckpt_io = OrbaxCheckpointIO(
        lambda: module.state, module.restore_from, export=_export_hook(resolved, module, twin)
    )
    # Every JAX process is Lightning's rank 0 of its own one-process run (as under `coreshell
    # launch`); Lightning read SLURM_PROCID at import otherwise, and a rank>0 skipped its
    # rank-zero hooks while process 0 ran them: the two left each other at a collective.
    rank_zero_only.rank = 0  # type: ignore[attr-defined]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=logger or False,
        callbacks=callbacks,
        # Lightning is one process per JAX process: it must not read SLURM/K8s itself
        plugins=[ckpt_io, LightningEnvironment()],
        enable_checkpointing=checkpointing,
        default_root_dir=str(out_dir),
        **args,
    )
    return trainer, sigterm


def _follow_main(
    cfg: Config, data: Any, module: JaxModule, twin: torch.nn.Module, metrics: dict[str, Any]
) -> dict[str, Any]:
    """A process > 0 after fit: joins process 0's collectives (export gather, parity
    predict) in the same order, and leaves logging and files to process 0."""
    module.torch_state_dict(twin)
    predict_test_split(module, data)
    return {"run_id": None, "tracking_uri": cfg.tracking.uri, "export": None, "metrics": metrics}


__all__ = ["Prepared", "resume_path", "train"]
