"""``LightningJaxModule``'s part: the user's ``LightningModule``, unchanged, trained as a JAX step.

What differs from the Flax path of :class:`~torchshell.module.JaxModule`:

- batches reach ``training_step`` with the structure the DataLoader gave (tuples, dicts,
  nested); nothing is padded (a ragged batch compiles once more, counted): the user's loss
  is a mean over the rows it is given, as in plain Lightning;
- ``configure_optimizers`` is read and mapped onto optax (:mod:`torchshell.port._optim`);
  its torch optimizers are also handed to Lightning, so ``LearningRateMonitor`` and the
  checkpoint's ``optimizer_states`` see them (their ``lr`` follows the JAX schedule);
- ``self.log`` values: on-step ones at the logging cadence, on-epoch ones as exact means
  accumulated on device (training), and through Lightning's own ``self.log`` per batch
  (evaluation), under the user's names and options;
- checkpoints carry the trained weights in the module's own ``state_dict`` layout and its
  ``hyper_parameters``: ``MyModule.load_from_checkpoint(path)`` works in plain Lightning.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

import bridge
import jaxcore
from torchshell import _state_io
from torchshell._batches import (
    MicroBatches,
    containers_as_nodes,
    host_fields_back,
    host_fields_out,
)
from torchshell._errors import ConfigError
from torchshell._flax_checks import check_lengths_and_masks
from torchshell._module_parts import _Shared
from torchshell.port._logs import GRADS_HOOKS, host_tensors
from torchshell.port._manual_parts import ManualParts
from torchshell.port._optim import MappedOptimizer, map_configure_optimizers
from torchshell.port._optim_rules import TorchOptState
from torchshell.port._optim_state import state_from_torch, state_to_torch
from torchshell.port._sched import parse_configure_optimizers
from torchshell.port._trace import LightningPort
from torchshell.port._user import UserEvaluation, UserMetrics
from torchshell.port._weights import synced_on_read

__all__ = ["LightningParts"]

_EVAL_HOOKS = ("validation_step", "test_step", "predict_step")
# the user's own loop and batch hooks, run on the host after coreshell's part of each (the
# optimizer/backward ones are refused: see docs/porting.md)
_LOOP_HOOKS = tuple(
    f"on_{stage}_{when}"
    for stage in (
        "fit",
        "train",
        "validation",
        "test",
        "predict",
        "train_epoch",
        "validation_epoch",
        "test_epoch",
        "predict_epoch",
    )
    for when in ("start", "end")
) + tuple(
    f"on_{stage}_batch_{when}"
    for stage in ("train", "validation", "test", "predict")
    for when in ("start", "end")
)
# the user's own batch transforms on the host (augmentation, moving fields): theirs alone
_TRANSFER_HOOKS = (
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
)
_DATA_HOOKS = (
    "prepare_data",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
)
# Hooks that run torch code around the backward pass or the torch optimizer: the JAX step has
# no place to run them, so a module that overrides one is refused rather than half-trained.
# (on_after_backward/on_before_optimizer_step run traced on the step's gradients: GRADS_HOOKS.)
_OPTIMIZER_HOOKS = (
    "backward",
    "on_before_zero_grad",
    "on_before_backward",
    "configure_gradient_clipping",
    "optimizer_step",
    "lr_scheduler_step",
)


def _first_rows(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.shape[0] if tree.ndim else 1
    items = tree.values() if isinstance(tree, Mapping) else tree
    if isinstance(tree, (Mapping, list, tuple)):
        for item in items:
            if n := _first_rows(item):
                return n
    return 0


class LightningParts(ManualParts, UserMetrics, UserEvaluation, _Shared):
    """What :class:`~torchshell.module.LightningJaxModule` adds to a ``JaxModule``.

    A part, not a ``JaxModule`` itself (``torchshell.module`` builds the class from it, so
    the port never imports the module that uses it); see the module docstring.

    Args:
        module: the user's ``LightningModule``.
        optimizer: an optax transform to use instead of ``configure_optimizers``.
        **kwargs: :class:`JaxModule` options.
    """

    # Lightning weighs each accumulated batch's loss equally (loss / accumulate_grad_batches),
    # whatever its rows or mask: the user's structure has no row count of coreshell's.
    _weigh_rows = False

    def __init__(
        self,
        module: L.LightningModule,
        *,
        optimizer: optax.GradientTransformation | None = None,
        **kwargs: Any,
    ) -> None:
        port = LightningPort(module)
        custom = [hook for hook in _OPTIMIZER_HOOKS if port.overrides(hook)]
        if custom and module.automatic_optimization:  # (manual: see ManualParts)
            raise ConfigError(
                f"{type(module).__name__} overrides {custom}: torch code around the backward "
                "pass or the optimizer step, which the compiled JAX step does not run. Fix: "
                "remove the override (gradient clipping: Trainer(gradient_clip_val=...)), or "
                "pass optimizer= an optax transform that does the same."
            )
        super().__init__(port.model_fns(), port.loss_fn, optimizer, **kwargs)
        object.__setattr__(self, "port", port)  # the user's module is not a submodule
        object.__setattr__(self, "torch_module", module)
        self.mapped: MappedOptimizer | None = None
        self._returned: Any = None  # configure_optimizers(): Lightning holds (and restores) it
        self._pristine: Any = None  # a copy as first returned: the schedule is mapped from it
        self._map_key: tuple[Any, ...] | None = None
        self._epoch: dict[str, Any] | None = None
        self._restore_weights: Mapping[str, torch.Tensor] | None = None
        self._restore_optim: Mapping[str, Any] | None = None  # torch optimizer.state_dict()
        self._restore_step = 0
        self._eval_steps: dict[str, jaxcore.Step] = {}
        for hook in _EVAL_HOOKS[:2]:  # Lightning skips a loop whose hook is not overridden
            # (predict_step stays: Lightning's default one calls the module's forward)
            if not port.overrides(hook):
                setattr(self, hook, getattr(L.LightningModule, hook).__get__(self))
        for hook in _LOOP_HOOKS:  # the user's own hooks run too, logging through Lightning
            if port.overrides(hook):
                setattr(self, hook, self._with_user_hook(hook))
        epoch_end = self.on_train_epoch_end  # (the user's own too, when it has one)

        def on_train_epoch_end() -> None:
            epoch_end()
            self._step_plateau()  # after every epoch-end hook, as Lightning steps it

        self.on_train_epoch_end = on_train_epoch_end  # type: ignore[method-assign]
        for hook in _DATA_HOOKS + _TRANSFER_HOOKS:  # the module's own loaders and transforms
            if port.overrides(hook):
                setattr(self, hook, getattr(module, hook))
        self._configs: list[Any] = []
        if module.hparams:  # the run's params in the loggers (MLflow) are the user's
            self.save_hyperparameters(dict(module.hparams))

    @property
    def batch_size(self) -> Any:
        """The user's module's ``batch_size`` (Lightning's batch size finder reads and sets it).

        Missing on the user's module: missing here too (``hasattr`` is false, as the finder
        expects).
        """
        return self.port.module.batch_size

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        self.port.module.batch_size = value

    def _with_user_hook(self, hook: str) -> Any:
        """``hook`` as coreshell runs it, then as the user's module does.

        The user's ``self.log``/``self.log_dict`` in it go to this module's (the one
        Lightning's loop is running), so what it logs reaches the loggers and
        ``callback_metrics`` as in plain Lightning. ``on_train_batch_end`` receives the step's
        outputs as plain Lightning gives them (:meth:`_outputs_wanted`); the evaluation
        hooks, what the traced step returned.
        """
        ours, theirs = getattr(self, hook), getattr(self.port.module, hook)

        def both(*args: Any, **kwargs: Any) -> Any:
            ours(*args, **kwargs)
            user = self.port.module
            user.log, user.log_dict = self.log, self.log_dict  # type: ignore[method-assign]
            try:
                with synced_on_read(user, self._sync_user_weights):
                    return theirs(*args, **kwargs)
            finally:
                del user.log, user.log_dict

        return both

    def _match_val_loader(self, trainer: L.Trainer) -> None:
        """The user's own hooks decide, as in plain Lightning; the module sees the Trainer.

        Its data hooks and ``configure_optimizers`` often read ``self.trainer`` (e.g.
        ``estimated_stepping_batches``). Inside the traced steps, Trainer values are read
        once, at trace time.
        """
        self.port.module.trainer = trainer

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.port.module.setup(stage)

    def teardown(self, stage: str) -> None:
        self.port.module.teardown(stage)
        super().teardown(stage)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The user's module called on the host with the weights trained so far.

        What a callback's ``pl_module(x)`` runs (sampling at an epoch's end), as in plain
        Lightning; the training and evaluation steps never call it (they are traced).
        """
        self._sync_user_weights()
        return self.port.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The user's module's own attributes (``pl_module.net``, ``pl_module.my_setting``
        in a callback), its weights the trained ones; private names are not forwarded."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            port = self.__dict__.get("port")
            if port is None or name.startswith("_") or not hasattr(port.module, name):
                raise
        value = getattr(port.module, name)
        if isinstance(value, torch.nn.Module | torch.Tensor):
            self._sync_user_weights()
        return value

    # -- optimizer ---------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        """The user's own optimizer and schedulers, handed to Lightning as plain objects.

        Lightning never steps them (manual optimization): the JAX step applies the mapped
        update, and their ``lr`` is kept equal to the JAX schedule for ``LearningRateMonitor``
        (the schedulers' ``interval``/``frequency`` are set on Lightning's configs in
        :meth:`on_fit_start`, which manual optimization would otherwise warn about).
        """
        if self.tx is not None:
            return []
        self._configured()
        if self.manual:  # the user's own return: its training_step steps them (by hand)
            return self._returned
        optimizer, configs = parse_configure_optimizers(self._returned)
        self._configs = configs
        return ([optimizer], [c.scheduler for c in configs]) if configs else optimizer

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.mapped is not None and self.trainer.ckpt_path is None:  # (plateau factors)
            self._lr_scale = np.ones(len(self.mapped.groups), np.float32)
        for mine, theirs in zip(self.trainer.lr_scheduler_configs, self._configs, strict=False):
            mine.interval, mine.frequency, mine.name = (
                theirs.interval,
                theirs.frequency,
                theirs.name,
            )

    def _configured(self) -> None:
        """Calls the user's ``configure_optimizers`` once, keeping a pristine copy.

        Lightning loads a checkpoint's optimizer and scheduler state into the returned
        objects; the JAX schedule is indexed by the restored step count, so it is mapped
        from the objects as they were before (the copy shares the module's parameters).
        """
        if self._returned is None:
            self._returned = self._user_configure_optimizers()
            shared = {id(p): p for p in self.port.module.parameters()}
            self._pristine = copy.deepcopy(self._returned, shared)

    def _user_configure_optimizers(self) -> Any:
        """The user's ``configure_optimizers()``, with the Trainer attached and its own flags.

        Modules size schedules from ``self.trainer.estimated_stepping_batches``, which reads
        ``accumulate_grad_batches``: the user's value is put back for the call.
        """
        user, trainer = self.port.module, self._trainer
        if trainer is None:
            return user.configure_optimizers()
        neutral = {k: getattr(trainer, k) for k in self._flag_originals or {}}
        for k, v in (self._flag_originals or {}).items():
            setattr(trainer, k, v)
        user.trainer = trainer
        try:
            return user.configure_optimizers()
        finally:
            for k, v in neutral.items():
                setattr(trainer, k, v)

    def _map(self, *, provisional: bool) -> None:
        self._configured()
        if self.manual:
            self._map_manual(provisional=provisional)
            return
        named = {
            k: v for k, v in self.port.module.named_parameters() if k in self.port.tracer.params0
        }
        trainer, m = self._trainer, self.flags.accumulate
        batches = None if trainer is None or provisional else trainer.num_training_batches
        if batches is None:  # before the loaders exist: the state's structure only
            per_epoch, total = 1, 1
        elif math.isinf(batches):  # an iterable loader: no epoch length
            assert trainer is not None  # (batches came from it)
            per_epoch, total = None, max(trainer.max_steps, 1)
        else:
            assert trainer is not None
            per_epoch = math.ceil(int(batches) / m)
            epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else 1
            total = trainer.max_steps if trainer.max_steps > 0 else per_epoch * epochs
        per_batches = None if batches is None or math.isinf(batches) else int(batches)
        key = (per_epoch, max(int(total), 1), m, per_batches)
        if key == self._map_key and self.mapped is not None:
            return  # (a later fit of the same run: the compiled step stays valid)
        self._map_key = key
        self.mapped = map_configure_optimizers(
            self._pristine,
            named,
            steps_per_epoch=per_epoch,
            total_steps=key[1],
            accumulate_grad_batches=m,
            batches_per_epoch=per_batches,
        )
        self._train_step = None  # the tables are constants of the compiled step
        self._short_steps = {}
        self._lr_scale = np.ones(len(self.mapped.groups), np.float32)  # (plateau: host copy)

    def optimizer(self) -> optax.GradientTransformation:
        if self.manual and self.tx is None:
            self._configured()
            return self.manual_plan.tx()
        if self.tx is None:
            if self.mapped is None:
                self._map(provisional=True)  # the state's structure; tables come at train start
            assert self.mapped is not None
            base = self.mapped.tx
        else:
            base = self.tx
        if self.flags.clip_val is None:
            return base
        from torchshell._clip import torch_clip

        only = None if self.mapped is None else self.mapped.param_names
        return optax.chain(
            torch_clip(self.flags.clip_val, self.flags.clip_algorithm, only=only), base
        )

    def on_train_start(self) -> None:
        super().on_train_start()
        if any(type(c).__name__ == "_LRCallback" for c in self.trainer.callbacks):
            raise ConfigError(
                "Lightning's learning-rate finder (Tuner.lr_find) sweeps the lr by swapping "
                "the torch optimizer's scheduler during fit; the compiled step runs the optax "
                "mapping of configure_optimizers() and would not follow it (a flat curve, a "
                "meaningless suggestion). Fix: choose the lr with a few short fits at "
                "different lr values, or run lr_find on the plain LightningModule."
            )
        if self.manual:
            self._check_manual()
        if self.tx is None:
            self._map(provisional=False)
            if self._trainer is not None and self.trainer.is_global_zero and self.mapped:
                print(f"coreshell: optimizer {self.mapped.description} (mapped onto optax)")

    def _sync_torch_lr(self) -> None:
        """The torch optimizers' ``lr`` follow the JAX schedule (LearningRateMonitor reads it)."""
        if self.mapped is None or not self.trainer.optimizers:
            return
        optimizer = self.trainer.optimizers[0]
        lrs = self._table_lrs(self.trainer.global_step)  # read on the host: no device work
        for index in self.mapped.lr_group:
            optimizer.param_groups[index]["lr"] = lrs[index] * float(self._lr_scale[index])

    def _table_lrs(self, step: int) -> list[float]:
        assert self.mapped is not None
        lrs = []
        for group in self.mapped.groups:
            table = group.tables.get("lr")
            lrs.append(
                float(group.const["lr"] if table is None else table[min(step, len(table) - 1)])
            )
        return lrs

    def _step_plateau(self) -> None:
        """Steps the user's ``ReduceLROnPlateau`` schedulers as Lightning does at an epoch's end.

        On the monitored value in ``callback_metrics`` (Lightning's ``strict`` rule when it
        is missing), every ``frequency`` epochs; the lr each group reaches becomes the JAX
        step's per-group factor on the tabulated lr (``TorchOptState.scale``, in the
        checkpointed state). The scheduler is the user's own object, which Lightning
        checkpoints and restores.
        """
        mapped = self.mapped
        if mapped is None or not mapped.plateau or self.tx is not None or self.state is None:
            return
        optimizer = self.trainer.optimizers[0]
        tables = self._table_lrs(self.trainer.global_step)
        scale = _scale_of(self.state.opt_state)
        for group, lr, factor in zip(optimizer.param_groups, tables, scale, strict=True):
            if not math.isclose(group["lr"], lr * float(factor), rel_tol=1e-6):
                group["lr"] = lr * float(factor)  # the lr the step uses now (float32 tables)
        for index in mapped.plateau:
            config = self._configs[index]
            if (self.trainer.current_epoch + 1) % config.frequency:
                continue
            value = self.trainer.callback_metrics.get(config.monitor)
            if value is None:
                message = (
                    f"ReduceLROnPlateau monitors {config.monitor!r}, which is not among the "
                    f"logged values {sorted(self.trainer.callback_metrics)}"
                )
                if config.strict:
                    raise ConfigError(
                        f"{message}. Fix: log it (e.g. self.log({config.monitor!r}, ...) in "
                        "validation_step), or set 'monitor' in the lr_scheduler dict to one of "
                        "those."
                    )
                warnings.warn(
                    f"{message}; strict=False: the lr is not updated.", RuntimeWarning, stacklevel=2
                )
                continue
            config.scheduler.step(value)
        new = np.asarray(
            [
                g["lr"] / lr if lr else 1.0
                for g, lr in zip(optimizer.param_groups, tables, strict=True)
            ],
            np.float32,
        )
        self._lr_scale = new
        if not np.array_equal(new, scale):
            self.state = self.state.replace(opt_state=_with_scale(self.state.opt_state, new))

    def _outputs_wanted(self) -> bool:
        """Also when the user's module overrides ``on_train_batch_end`` itself."""
        return self.port.overrides("on_train_batch_end") or super()._outputs_wanted()

    def _outputs_ahead(self, batch: Any, i: int, raw: Any) -> dict[str, Any] | None:
        """Lightning's outputs, computed before the step when ``training_step`` returns more
        than its loss or appends to the module's lists (Lightning 2's
        ``self.training_step_outputs.append(...)``): the lists get the values after each
        batch, ``on_train_batch_end`` the returned dict (its loss / ``accumulate_grad_batches``,
        as Lightning gives it). This runs the batch's forward pass alone, so such a module
        computes it twice per batch.
        """
        self.init_state(batch)  # (the first batch traces training_step: now it is known)
        extras, appends = self.port.returns_more
        wanted = self._outputs_wanted()
        if not appends and not (extras and wanted):  # (extras no one reads: not computed)
            return super()._outputs_ahead(batch, i, raw)
        outputs, loss = self._step_forward(batch, i)
        user = host_tensors(outputs["user"])
        for name, items in user["appended"].items():
            getattr(self.port.module, name).extend(host_fields_back(items, raw))
        if not wanted:
            return None
        extras = host_fields_back(user["extras"], raw)  # (ids: the DataLoader's values)
        return {"loss": torch.tensor(float(loss)) / self.flags.accumulate, **extras}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if any(type(c).__name__ == "LearningRateMonitor" for c in self.trainer.callbacks):
            self._sync_torch_lr()
        super().on_train_batch_end(outputs, batch, batch_idx)

    # -- hand-over: the user's structure, no padding -------------------------------------------
    def _prepare(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):  # named fields: negative lengths, misfit masks
            check_lengths_and_masks(batch, row_mask=False)  # its 'mask' is the user's
        self.port.embeddings.check(batch)  # (the fields are known once the step is traced)
        return host_fields_out(batch)

    def _leading(self, tree: Any, axis: int = 0) -> int:
        sizes = {t.shape[axis] for t in jax.tree.leaves(tree) if getattr(t, "ndim", 0) > axis}
        return sizes.pop() if len(sizes) == 1 else 0

    def _placed(self, tree: Any, stacked: bool) -> Any:
        ways = self.mesh.shape[self.data_axis]
        n = self._leading(tree, 1 if stacked else 0)
        if n and n % ways == 0:
            sharding = self.window_sharding if stacked else self.batch_sharding
        else:  # rows the data axis does not divide: the whole batch on every device
            sharding = NamedSharding(self.mesh, PartitionSpec())
        return bridge.to_jax(tree, sharding, stats=self.transfer_stats)

    def _to_jax(self, batch: Any, rows_: int | None = None) -> Any:
        return self._placed(batch, stacked=False)

    def _sample(self, batch: Any) -> Any:
        containers_as_nodes(batch)  # (the first batch may come before any hand-over)
        return self.port.specialise("training_step", self._placed(batch, stacked=False), True)

    def _global_rows(self, batch: Any) -> int:
        """Rows of a batch: its fields' common leading size, else Lightning's batch size (the
        first tensor's, in the batch's own order: e.g. a dict of several loaders' batches)."""
        return self._leading(batch) or _first_rows(batch)

    def _stack(self, batches: list[Any]) -> Any:
        """The window's batches stacked ``[m, B, ...]``; as :class:`MicroBatches` when their
        shapes differ (a ragged last batch: the step unrolls them, each its own shape)."""
        self.port.specialise("training_step", self._placed(batches[0], stacked=False), True)
        if self.port.needs_statics("training_step"):
            raise ConfigError(
                f"accumulate_grad_batches={self.flags.accumulate}: "
                f"{type(self.port.module).__name__}.training_step reads batch values in Python "
                "(e.g. int(lengths.max())), which differ between the accumulated batches of "
                "one compiled step. Fix: accumulate_grad_batches=1 with a larger batch, or "
                "keep those values tensors (masks instead of lengths.max())."
            )
        if len({repr(jax.tree.map(lambda t: tuple(t.shape), b)) for b in batches}) > 1:
            return MicroBatches(self._placed(b, stacked=False) for b in batches)
        stacked = jax.tree.map(lambda *ts: torch.stack(ts), *batches)
        return self._placed(stacked, stacked=True)

    def _grads_fn(self) -> Any:
        """The module's ``on_after_backward``/``on_before_optimizer_step``, traced on the
        step's gradients (``LightningPort.grads_fn``), or ``None`` when it has neither."""
        hooks = tuple(hook for hook in GRADS_HOOKS if self.port.overrides(hook))
        if not hooks or self.manual:  # (manual: refused, see ManualParts)
            return None
        if "on_after_backward" in hooks and self.flags.accumulate > 1:
            raise ConfigError(
                f"{type(self.port.module).__name__}.on_after_backward with "
                f"accumulate_grad_batches={self.flags.accumulate}: Lightning runs it after "
                "each batch's backward, on partly accumulated gradients, which the compiled "
                "step never holds (it sums the window's gradients at once). Fix: move the "
                "code to on_before_optimizer_step (the window's gradients), or "
                "accumulate_grad_batches=1."
            )
        optimizers = self.trainer.optimizers if self._trainer is not None else []
        return self.port.grads_fn(hooks, optimizers[0] if optimizers else None)

    def _one_step_view(self, batch: Any) -> tuple[Any, Any, int]:
        if self.steps_per_call > 1:
            raise ConfigError(
                "steps_per_call > 1 is not supported by JaxModule.from_lightning (the user's "
                "batches are not re-stacked). Fix: use steps_per_call=1."
            )
        jbatch = self.port.specialise("training_step", self._placed(batch, stacked=False), True)
        return jbatch, batch, self._global_rows(batch)

    def _batch_check(self, batch: Any) -> Any:
        return contextlib.nullcontext()  # the traced step names its own errors

    # -- weights -----------------------------------------------------------------------------
    def init_state(self, batch: Any) -> Any:
        fresh = self.state is None
        state = super().init_state(batch)
        if fresh:
            self.port.embeddings.check(batch)  # the batch the trace found the fields on
        if fresh and self._restore_weights is not None:
            self.state = self._with_weights(state, self._restore_weights)
            self._restore_weights = None
        return self.state

    def _with_weights(self, state: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        """The state with a plain Lightning checkpoint's weights (and optimizer state)."""

        def put(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return {
                k: jax.device_put(bridge.as_jax(sd[k], name=k).astype(v.dtype), v.sharding)
                for k, v in tree.items()
            }

        state = state.replace(params=put(state.params), model_state=put(state.model_state))
        torch_opt, self._restore_optim = self._restore_optim, None
        if self.manual and torch_opt is not None and self.tx is None:  # (the whole .ckpt)
            return self._manual_restore(state, torch_opt)
        if torch_opt is None or self.mapped is None or self.tx is not None:
            print(
                "coreshell: starting from the checkpoint's weights; it holds no optimizer state "
                "this run can map, so the JAX optimizer starts fresh."
            )
            return state
        step = int(self._restore_step)
        mapped_state = state_from_torch(self.mapped, torch_opt, state.params, step=step)
        opt_state = state.opt_state
        if isinstance(opt_state, tuple) and not hasattr(opt_state, "_fields"):  # (clip, tx)
            opt_state = (opt_state[0], mapped_state)
        else:
            opt_state = mapped_state
        shardings = jax.tree.map(lambda x: x.sharding, state.opt_state)
        return state.replace(
            opt_state=jax.device_put(opt_state, shardings),
            step=jax.device_put(jnp.asarray(step, state.step.dtype), state.step.sharding),
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Takes the user's ``state_dict`` (a plain Lightning checkpoint of the same module)."""
        expected = set(self.port.module.state_dict())
        got = set(state_dict)
        if strict and got != expected:
            raise ConfigError(
                f"The checkpoint's state_dict does not match {type(self.port.module).__name__}:"
                f" missing {sorted(expected - got)[:5]}, unexpected {sorted(got - expected)[:5]}."
                " Fix: resume from a checkpoint of the same module class and hyperparameters."
            )
        if self.state is not None:
            if self._restore_tensors is None:
                self.state = self._with_weights(self.state, state_dict)
        elif self._restore_tensors is None:
            self._restore_weights = dict(state_dict)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        user = self.port.module
        if self.state is None:  # before the first step (Lightning's tuner saves one): as built
            checkpoint["state_dict"] = user.state_dict()
        else:
            checkpoint["state_dict"] = self.torch_state_dict()
            if self.manual and self.tx is None:
                self._manual_checkpoint(checkpoint)
            elif self.mapped is not None and self.tx is None:  # plain Lightning resumes from it
                opt_state = self.state.opt_state
                if self.flags.clip_val is not None:
                    opt_state = opt_state[1]
                optimizer, schedulers = state_to_torch(self.mapped, opt_state)
                for index in self.mapped.plateau:  # stepped on the host: the live objects'
                    schedulers[index] = self._configs[index].scheduler.state_dict()
                    live = self.trainer.optimizers[0].param_groups  # (exact, not float32)
                    for group, now in zip(optimizer["param_groups"], live, strict=True):
                        group["lr"] = now["lr"]
                checkpoint["optimizer_states"] = [optimizer]
                checkpoint["lr_schedulers"] = schedulers
        if user.hparams:
            checkpoint["hyper_parameters"] = dict(user.hparams)
            name = getattr(user, "_hparams_name", None)
            if name:
                checkpoint["hparams_name"] = name
        user.on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.port.module.on_load_checkpoint(checkpoint)
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        auto = loop.get("epoch_loop.automatic_optimization.optim_progress", {})
        manual = loop.get("epoch_loop.manual_optimization.optim_step_progress")
        steps = auto.get("optimizer", {}).get("step")
        if steps and manual is not None and not manual["total"]["completed"]:
            # a plain Lightning run counted its optimizer steps under automatic optimization
            loop["epoch_loop.manual_optimization.optim_step_progress"] = steps
        if _state_io.STATE_KEY not in checkpoint and checkpoint.get("optimizer_states"):
            self._restore_optim = checkpoint if self.manual else checkpoint["optimizer_states"][0]
            self._restore_step = int(checkpoint.get("global_step", 0))


def _scale_of(opt_state: Any) -> np.ndarray:
    """The mapped optimizer's per-group lr factor (host copy) from a (chained) optax state."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, TorchOptState)):
        if isinstance(node, TorchOptState) and node.scale is not None:
            return np.asarray(node.scale)
    raise ValueError("no TorchOptState with a scale in the optimizer state")


def _with_scale(opt_state: Any, scale: np.ndarray) -> Any:
    """``opt_state`` with the mapped optimizer's per-group lr factor replaced (same sharding)."""

    def put(node: Any) -> Any:
        if isinstance(node, TorchOptState) and node.scale is not None:
            value = jax.device_put(jnp.asarray(scale, jnp.float32), node.scale.sharding)
            return node._replace(scale=value)
        return node

    return jax.tree.map(put, opt_state, is_leaf=lambda x: isinstance(x, TorchOptState))
