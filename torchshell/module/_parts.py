"""The parts of :class:`~torchshell.module.JaxModule` that are not yet the adapter's.

- :class:`TrainerFlagsPart`: the Lightning Trainer's flags, read when the module is attached
  (see :mod:`torchshell.module._flags`), and the optimizer they shape;
- :class:`~torchshell.module._evaluation.EvaluationPart` (its own module): exact masked
  validation/test means, and prediction;
- :class:`~torchshell.module._checkpoint.CheckpointPart` (its own module): what a checkpoint
  holds of the JAX state, and restoring it.

How batches are handed to JAX is the module's adapter's (:mod:`torchshell.adapters`), and so
is the optimizer: :class:`~torchshell.adapters.OptaxOptimizer` is the Flax and torch
adapters' group (``adapter.optim``), which the hooks here call. The parts share the attributes
:class:`~torchshell.module.JaxModule` sets in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import lightning as L
import optax
import torch

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.module._flags import TrainerFlags, adopt_flags

Batch = Any


__all__ = ["TrainerFlagsPart"]


class _Shared(L.LightningModule):
    """The attributes :class:`~torchshell.module.JaxModule` sets, typed for every part."""

    batch_keys: tuple[str, ...]
    model_fns: jaxcore.ModelFns
    loss_fn: Any
    tx: optax.GradientTransformation | None
    mesh: Any
    seed: int
    data_axis: str
    steps_per_call: int
    accum_steps: int
    compute_dtype: str | None
    nan_policy: str
    hlo_dump_dir: Any
    print_summary: bool
    shard_fn: Any
    placement: Any  # torchshell.adapters._base.Placement
    adapter: Any  # torchshell.adapters._base.Adapter
    state: Any
    _state: Any
    windows: Any  # torchshell.module._windows.Windows
    evaluation: Any  # torchshell.module._evaluation.Evaluation
    flags: TrainerFlags
    run_scope: Any  # torchshell.module._run_scope.RunScope
    held: Any  # torchshell.module._checkpoint.Held
    accumulation: Any  # torchshell.module._accumulation.Accumulation
    _float_fields: list[str] | None
    _wants_outputs: tuple[Any, bool]
    _last_metrics: dict[str, jax.Array]
    compiled: Any  # torchshell.module._compiled.Compiled
    train_log: Any

    @property
    def torch_module(self) -> torch.nn.Module | None:
        """The user's ``nn.Module`` (``from_torch``, ``from_lightning``), else ``None``."""
        return self.adapter.torch_module  # type: ignore[no-any-return]

    @property
    def transfer_stats(self) -> bridge.TransferStats:
        """Hand-over counts: bytes and copies of the batches given to JAX."""
        return self.placement.stats  # type: ignore[no-any-return]

    # methods another part (or JaxModule) defines
    optimizer: Callable[[], optax.GradientTransformation]
    init_state: Callable[[Any], Any]
    torch_state_dict: Callable[..., dict[str, torch.Tensor]]
    _outputs_wanted: Callable[[], bool]
    _step_forward: Callable[[Any, int], tuple[Any, jax.Array]]
    _log_to_loggers: Callable[[dict[str, float]], None]


class TrainerFlagsPart(_Shared):
    # -- the Trainer's flags (read when Lightning attaches the module) ----------------------
    @property  # type: ignore[override]
    def trainer(self) -> L.Trainer:
        return L.LightningModule.trainer.fget(self)  # type: ignore[attr-defined,no-any-return]

    @trainer.setter
    def trainer(self, trainer: L.Trainer | None) -> None:
        L.LightningModule.trainer.fset(self, trainer)  # type: ignore[attr-defined]
        if trainer is not None and self.run_scope.originals is None:
            flags, self.run_scope.originals = adopt_flags(trainer)
            self._adopt(flags)
            self.adapter.hooks.trainer_attached(self, trainer)  # (the val loader matched)

    # -- the run's loaders, checked before their workers start --------------------------------
    def on_train_start(self) -> None:
        self.run_scope.check_workers(self.trainer.train_dataloader)
        self.run_scope.read_by_gathers(self.trainer.train_dataloader)
        self.adapter.optim.on_train_start(self)

    def on_validation_start(self) -> None:
        self.run_scope.check_workers(self.trainer.val_dataloaders)
        self.run_scope.read_by_gathers(self.trainer.val_dataloaders)

    def on_test_start(self) -> None:
        self.run_scope.check_workers(self.trainer.test_dataloaders)
        self.run_scope.read_by_gathers(self.trainer.test_dataloaders)

    def on_predict_start(self) -> None:
        self.run_scope.check_workers(self.trainer.predict_dataloaders)
        self.run_scope.read_by_gathers(self.trainer.predict_dataloaders)

    def _adopt(self, flags: TrainerFlags) -> None:
        if flags.compute_dtype is not None and self.compute_dtype not in (
            None,
            flags.compute_dtype,
        ):
            raise ConfigError(
                f"Trainer(precision=...) asks for {flags.compute_dtype} compute but the "
                f"module was built with compute_dtype={self.compute_dtype!r}. Fix: set one "
                "of the two."
            )
        if flags != self.flags:
            self.compiled.drop()
            self.evaluation.step = self.evaluation.predict_step = None
        if self.flags.clip_val != flags.clip_val and self.state is not None:
            raise ConfigError(
                "gradient_clip_val changed after the optimizer state was built. Fix: use "
                "the same Trainer flags for every fit of one module."
            )
        self.flags = flags

    @property
    def _compute_dtype(self) -> str | None:
        return self.compute_dtype or self.flags.compute_dtype

    def setup(self, stage: str) -> None:
        self.run_scope.open()  # (undone in teardown)
        self.adapter.hooks.setup(self, stage)  # (the port: the user's own setup)

    def teardown(self, stage: str) -> None:
        self.adapter.hooks.teardown(self, stage)
        self.run_scope.close(self._trainer)

    def configure_optimizers(self) -> Any:
        """What the adapter's optimizer group hands Lightning (:class:`OptaxOptimizer`)."""
        return self.adapter.optim.configure_optimizers(self)

    def optimizer(self) -> optax.GradientTransformation:
        """The optax transform the step applies (the adapter's optimizer group's)."""
        return self.adapter.optim.optimizer(self)  # type: ignore[no-any-return]
