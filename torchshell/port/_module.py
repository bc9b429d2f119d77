"""``LightningJaxModule``'s part: the user's ``LightningModule``, unchanged, trained as a JAX step.

What differs from the Flax path of :class:`~torchshell.module.JaxModule`:

- batches reach ``training_step`` with the structure the DataLoader gave (tuples, dicts,
  nested); nothing is padded (a ragged batch compiles once more, counted): the user's loss
  is a mean over the rows it is given, as in plain Lightning;
- ``configure_optimizers`` is read and mapped onto optax (:mod:`torchshell.optim._map`);
  its torch optimizers are also handed to Lightning, so ``LearningRateMonitor`` and the
  checkpoint's ``optimizer_states`` see them (their ``lr`` follows the JAX schedule);
- ``self.log`` values: on-step ones at the logging cadence, on-epoch ones as exact means
  accumulated on device (training), and through Lightning's own ``self.log`` per batch
  (evaluation), under the user's names and options;
- checkpoints carry the trained weights in the module's own ``state_dict`` layout and its
  ``hyper_parameters``: ``MyModule.load_from_checkpoint(path)`` works in plain Lightning.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import optax
import torch

from torchshell._errors import ConfigError
from torchshell.module._batches import (
    host_fields_back,
)
from torchshell.module._parts import _Shared
from torchshell.port._adapter import LightningAdapter
from torchshell.port._logs import GRADS_HOOKS, host_tensors
from torchshell.port._prepare import check_trainable, layers_changed
from torchshell.port._trace import LightningPort
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


class LightningParts(_Shared):
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
        if custom and module.automatic_optimization:  # (manual: see LightningSteps)
            raise ConfigError(
                f"{type(module).__name__} overrides {custom}: torch code around the backward "
                "pass or the optimizer step, which the compiled JAX step does not run. Fix: "
                "remove the override (gradient clipping: Trainer(gradient_clip_val=...)), or "
                "pass optimizer= an optax transform that does the same."
            )
        super().__init__(port.model_fns(), port.loss_fn, optimizer, **kwargs)
        object.__setattr__(self, "port", port)  # the user's module is not a submodule
        self.adapter = LightningAdapter(self.model_fns, self.placement, port)
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
            self.adapter.optim.step_plateau(self)  # after every epoch-end hook, as Lightning

        self.on_train_epoch_end = on_train_epoch_end  # type: ignore[method-assign]
        epoch_start = self.on_train_epoch_start

        def on_train_epoch_start() -> None:
            epoch_start()  # (after the callbacks' and the user's: a freeze or unfreeze there)
            # before the first step (a freeze in on_train_start): traced and mapped anew
            if (
                self.state is None
                and not self.adapter.steps.manual
                and port.refresh()
                and self.tx is None
            ):
                self.adapter.optim.remap(self)
            optimizers = None if self.tx is not None else self.trainer.optimizers
            check_trainable(port.module, port.tracer, optimizers, self.current_epoch)

        self.on_train_epoch_start = on_train_epoch_start  # type: ignore[method-assign]
        for hook in _DATA_HOOKS + _TRANSFER_HOOKS:  # the module's own loaders and transforms
            if port.overrides(hook):
                setattr(self, hook, getattr(module, hook))
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
            steps = self.adapter.steps
            if steps.manual:  # (its sch.step() moves the compiled step's schedule)
                host = functools.partial(steps.host_schedulers, self)
                user.lr_schedulers = host  # type: ignore[method-assign]
            try:
                with synced_on_read(user, self._sync_user_weights):
                    return theirs(*args, **kwargs)
            finally:
                del user.log, user.log_dict
                user.__dict__.pop("lr_schedulers", None)

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
        if self.state is None:  # (layers its setup built: traced and trained, as in Lightning)
            self.port.refresh()
        elif layers_changed(self.port.module, self.port.tracer):
            raise ConfigError(
                f"{type(self.port.module).__name__}.setup({stage!r}) changed the module's "
                "layers after its weights were already in the JAX state (an earlier fit or a "
                "restored checkpoint). Fix: make setup idempotent (build a layer only when it "
                "is missing: `if self.head is None:`), or build the layers in __init__."
            )

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
        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]
        if any(type(c).__name__ == "LearningRateMonitor" for c in callbacks):
            self.adapter.optim.sync_torch_lr(self)
        super().on_train_batch_end(outputs, batch, batch_idx)

    def _grads_fn(self) -> Any:
        """The module's ``on_after_backward``/``on_before_optimizer_step``, traced on the
        step's gradients (``LightningPort.grads_fn``), or ``None`` when it has neither."""
        hooks = tuple(hook for hook in GRADS_HOOKS if self.port.overrides(hook))
        if not hooks or self.adapter.steps.manual:  # (manual: refused, see LightningSteps)
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
