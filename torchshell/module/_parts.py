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

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import lightning as L
import optax
import torch

import bridge
import jaxcore
from torchshell._errors import ConfigError
from torchshell.module._flags import TrainerFlags, adopt_flags, restore_flags

Batch = Any

# Lightning warns that a manual-optimization checkpoint holds the state *after* the optimizer
# step; the JAX state of step N is exactly what a JaxModule checkpoint at step N should hold.
_AFTER_STEP_WARNING = "Using ModelCheckpoint with manual optimization and every_n_train_steps"

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
    _flag_originals: dict[str, Any] | None
    _train_step: jaxcore.Step | None
    _short_steps: dict[tuple[int, bool], jaxcore.Step]
    _train_forward: jaxcore.Step | None
    _restore_dir: Path | None
    _restore_tensors: dict[str, torch.Tensor] | None
    _synced: Any  # the state whose weights torch_module holds
    _quiet: contextlib.ExitStack | None
    accumulation: Any  # torchshell.module._accumulation.Accumulation
    _float_fields: list[str] | None
    _stats_due: bool
    _wants_outputs: tuple[Any, bool]
    _gathered: list[Any]
    _fork_warned: set[int]
    _last_metrics: dict[str, jax.Array]
    _pending: Any
    compile_stats: Any
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
        if trainer is not None and self._flag_originals is None:
            flags, self._flag_originals = adopt_flags(trainer)
            self._adopt(flags)
            self.adapter.hooks.trainer_attached(self, trainer)  # (the val loader matched)

    # -- the run's loaders, checked before their workers start --------------------------------
    def on_train_start(self) -> None:
        self._check_workers(self.trainer.train_dataloader)
        self._read_by_gathers(self.trainer.train_dataloader)
        self.adapter.optim.on_train_start(self)

    def _read_by_gathers(self, loaders: Any) -> None:
        """Plain ``TensorDataset`` loaders gather their batches while this run lasts (the same
        batches, ~5x faster to build: :mod:`torchshell.data._gathered`); undone in teardown."""
        from torchshell.data import loaders_in
        from torchshell.data._gathered import gatherable, read_by_gathers

        gathered = self._gathered
        for loader in filter(gatherable, loaders_in(loaders)):
            if all(loader is not done for done in gathered):  # (validation runs repeat)
                read_by_gathers(loader)
                gathered.append(loader)

    def on_validation_start(self) -> None:
        self._check_workers(self.trainer.val_dataloaders)
        self._read_by_gathers(self.trainer.val_dataloaders)

    def on_test_start(self) -> None:
        self._check_workers(self.trainer.test_dataloaders)
        self._read_by_gathers(self.trainer.test_dataloaders)

    def on_predict_start(self) -> None:
        self._check_workers(self.trainer.predict_dataloaders)
        self._read_by_gathers(self.trainer.predict_dataloaders)

    def _check_workers(self, loaders: Any) -> None:
        """One warning per loader whose workers would fork after JAX started, with the fix."""
        from torchshell.data import forking_loaders

        warned = self._fork_warned
        for loader in forking_loaders(loaders):
            if id(loader) not in warned:
                warned.add(id(loader))
                warnings.warn(
                    f"DataLoader(num_workers={loader.num_workers}) starts its workers with "
                    "fork, after JAX started its threads: JAX warns at every worker start that "
                    "this may deadlock. Fix: DataLoader(..., multiprocessing_context='spawn', "
                    "persistent_workers=True) (torchshell.data.loader_kwargs(n, seed) gives "
                    "both; spawned workers need a picklable Dataset and a script guarded by "
                    "`if __name__ == '__main__':`).",
                    UserWarning,
                    stacklevel=2,
                )

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
            self._train_step = None
            self.evaluation.step = self.evaluation.predict_step = None
            self._train_forward = None
            self._short_steps = {}
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
        # (see _AFTER_STEP_WARNING); scoped to this run, undone in teardown
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=_AFTER_STEP_WARNING, category=UserWarning)
        self.adapter.hooks.setup(self, stage)  # (the port: the user's own setup)

    def teardown(self, stage: str) -> None:
        self.adapter.hooks.teardown(self, stage)
        from torchshell.data._gathered import read_normally

        for loader in self._gathered:
            read_normally(loader)
        self._gathered = []
        if self._quiet is not None:
            self._quiet.close()
            self._quiet = None
        if self._flag_originals is not None and self._trainer is not None:
            restore_flags(self.trainer, self._flag_originals)
        self._flag_originals = None

    def configure_optimizers(self) -> Any:
        """What the adapter's optimizer group hands Lightning (:class:`OptaxOptimizer`)."""
        return self.adapter.optim.configure_optimizers(self)

    def optimizer(self) -> optax.GradientTransformation:
        """The optax transform the step applies (the adapter's optimizer group's)."""
        return self.adapter.optim.optimizer(self)  # type: ignore[no-any-return]
