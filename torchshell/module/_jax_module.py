"""``JaxModule``: a ``LightningModule`` whose compute is a jitted, mesh-sharded JAX step."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import lightning as L
import optax
import torch
from flax import nnx
from jax.sharding import Mesh

import bridge
import jaxcore
from jaxcore import ModelFns, TrainState
from torchshell._errors import ConfigError
from torchshell.adapters import Adapter, FlaxAdapter, Placement, TorchAdapter
from torchshell.adapters._base import input_names, model_functions, step_loss
from torchshell.adapters._hooks import dispatching_hooks
from torchshell.adapters._logs import TrainLog
from torchshell.adapters._optim import optax_options
from torchshell.module._accumulation import Accumulation
from torchshell.module._checkpoint import (
    Held,
    fit_end,
    fit_start,
    load,
    restore_from,
    save,
    sync_user_weights,
)
from torchshell.module._compiled import Compiled
from torchshell.module._evaluation import Evaluation, eval_epoch_end
from torchshell.module._flags import TrainerFlags, attached
from torchshell.module._logging import check_finite, log_values, outputs_wanted
from torchshell.module._run_scope import RunScope
from torchshell.module._training import init_state, run_window, step_forward, train_batch
from torchshell.module._windows import Windows, resolve_steps_per_call
from torchshell.port import LightningAdapter, LightningPort

LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]
Batch = Mapping[str, torch.Tensor]


@dispatching_hooks  # (the eval steps, loaders, hooks it has no part in: the adapter's)
class JaxModule(L.LightningModule):
    """Runs jaxcore train/eval/predict steps inside the real ``lightning.Trainer``.

    Lightning drives the loop (epochs, validation cadence, callbacks, loggers); each batch
    crosses to JAX through :func:`bridge.to_jax` (zero-copy where the layout allows, ragged
    batches padded with a ``mask``) and the step runs jitted and sharded on ``mesh``. There is
    no torch optimizer: ``global_step`` counts JAX optimizer steps. A short step's batches run
    K per jitted call (:mod:`torchshell.module._windows`); ``steps_per_call=K`` views a batch of
    ``K * B`` rows as K. Metrics stay on device, fetched every ``log_every_n_steps`` steps.

    Batches come as the DataLoader yields them: a dict of tensors, or a list/tuple whose
    positions ``batch_keys`` names. The Trainer's flags are carried out in the JAX step.

    Args:
        model: a Flax linen module, a Flax NNX module, or :class:`jaxcore.ModelFns`.
        loss_fn: ``(outputs, batch) -> (loss[B], {name: metric[B]})``; a loss that returns
            only the loss, or batch means, is evaluated per row (:func:`jaxcore.per_example`).
        optimizer: an optax ``GradientTransformation`` (e.g. :func:`jaxcore.make_optimizer`).
        mesh: the device mesh; every device on one ``data`` axis by default.
        inputs: batch keys (or positions of a tuple batch) a linen module reads.
        batch_keys: names of the positions of a list/tuple batch.
        seed: seeds the params and the step's rng.
        sharding: a partition preset of :data:`jaxcore.PRESETS` (``dp``, ``fsdp``, ``tp``...).
        rules: explicit ``[(regex, PartitionSpec)]`` rules tried before the preset's.
        data_axis: the mesh axis the batch is split over.
        model_axis: the tensor-parallel mesh axis.
        steps_per_call: ``"auto"`` (K batches per call, K measured) or K (a batch of K * B rows).
        accum_steps: micro-batches per optimizer step (gradient accumulation within a batch).
        compute_dtype: ``"float32"`` or ``"bfloat16"`` for the forward/backward pass.
        nan_policy: ``"stop"``, ``"skip"`` or ``"none"`` (see :mod:`jaxcore.guard`).
        hlo_dump_dir: write the train step's jaxpr/StableHLO/HLO here at its first compile.
        print_summary: print the JAX parameter tree's summary when the state is built.
        adapter: ``(model_fns, placement) -> Adapter``: how the model came in (``from_*``).

    Example:
        >>> import jaxcore, lightning as L
        >>> from jaxcore.models.digits import MLP
        >>> from torchshell.data.digits import DigitsDataModule
        >>> module = JaxModule(MLP(features=(32,)), jaxcore.softmax_cross_entropy,
        ...                    jaxcore.make_optimizer(lr=1e-2), print_summary=False)
        >>> trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False,
        ...                     enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(module, DigitsDataModule(batch_size=32))
        >>> trainer.global_step
        3
    """

    def __init__(
        self,
        model: nn.Module | nnx.Module | ModelFns,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation | None,
        *,
        mesh: Mesh | None = None,
        inputs: Sequence[str | int] = ("x",),
        batch_keys: Sequence[str] = ("x", "y"),
        seed: int = 0,
        sharding: str | None = "dp",
        rules: Sequence[Any] | None = None,
        data_axis: str = "data",
        model_axis: str = "model",
        steps_per_call: int | str = "auto",
        accum_steps: int = 1,
        compute_dtype: str | None = None,
        nan_policy: str = "stop",
        hlo_dump_dir: str | Path | None = None,
        print_summary: bool = True,
        adapter: Callable[[ModelFns, Placement], Adapter] | None = None,
    ) -> None:
        super().__init__()
        steps_per_call, auto = resolve_steps_per_call(steps_per_call)
        self.windows = Windows(auto)  # K batches per call (see module._windows)
        self.evaluation = Evaluation()  # its steps and epoch sums (module._evaluation)
        self._last_metrics: dict[str, jax.Array] = {}
        self.automatic_optimization = False
        self.batch_keys = tuple(batch_keys)
        names = input_names(inputs, self.batch_keys)
        nnx_model = isinstance(model, nnx.Module)
        self.model_fns = model_functions(model, names)
        self.tx = optax_options(optimizer, accum_steps)
        self.mesh = mesh if mesh is not None else jaxcore.make_mesh({data_axis: -1})
        self.seed = seed
        self.data_axis = data_axis
        self.steps_per_call = steps_per_call
        self.accum_steps = accum_steps
        self.compute_dtype = compute_dtype
        self.nan_policy = nan_policy
        self.hlo_dump_dir = hlo_dump_dir
        self.print_summary = print_summary
        self.shard_fn = jaxcore.state_sharding_fn(
            self.mesh, sharding, rules, data_axis=data_axis, model_axis=model_axis
        )
        self.placement = Placement(self.mesh, data_axis, steps_per_call)
        self.adapter: Adapter = (
            adapter(self.model_fns, self.placement)
            if adapter is not None
            else FlaxAdapter(self.model_fns, self.placement, self.batch_keys, nnx_model=nnx_model)
        )
        self.loss_fn = step_loss(loss_fn, names, self.batch_keys, per_row=self.adapter.weigh_rows)
        self._state: TrainState | None = None
        self.summary = ""
        self.flags = TrainerFlags()
        self.compiled = Compiled()  # the train programs, dropped as a whole
        self.held = Held()  # a restore waiting for the state; the state torch_module holds
        self.accumulation = Accumulation()  # Trainer(accumulate_grad_batches=m)'s window
        self._float_fields: list[str] | None = None  # names the input NaN/Inf came in
        self.train_log = TrainLog(functools.partial(self.adapter.logs.emit, self))
        self._wants_outputs: tuple[Any, bool] = (None, False)  # (trainer, callbacks): wanted
        self.run_scope = RunScope()  # what a run changes (flags, loaders), undone at its end
        self.adapter.hooks.attach(self)  # (its hook table; the port: the user's loaders...)

    @classmethod
    def from_torch(
        cls,
        module: torch.nn.Module,
        loss_fn: LossFn | torch.nn.Module,
        optimizer: optax.GradientTransformation | torch.optim.Optimizer,
        *,
        inputs: Sequence[str | int] = ("x",),
        **kwargs: Any,
    ) -> JaxModule:
        """A :class:`JaxModule` training a team's own ``nn.Module``, traced by torchax.

        Its weights are the params (keyed by ``state_dict`` names), its buffers the model
        state; ``module`` is not changed: :meth:`torch_state_dict` gives the trained weights.

        Args:
            module: the team's ``nn.Module``.
            loss_fn: a torch loss (``nn.CrossEntropyLoss()``, ``F.mse_loss``: its mean exact
                over the real rows, :mod:`torchshell.trace._loss`) or a JAX ``loss_fn``.
            optimizer: a ``torch.optim`` optimizer over ``module.parameters()`` (SGD, Adam(W),
                RMSprop, Adagrad, Adamax, NAdam, RAdam: torch's math) or an optax transform.
            inputs: the batch fields (or tuple positions) fed to ``module.forward``; as
                positions without ``batch_keys``, the next one is the target ``y``.
            **kwargs: :class:`JaxModule` options.

        Example:
            >>> net = torch.nn.Linear(4, 3)
            >>> jm = JaxModule.from_torch(net, torch.nn.CrossEntropyLoss(),
            ...                           torch.optim.SGD(net.parameters(), lr=0.1),
            ...                           print_summary=False)
            >>> type(jm).__name__
            'JaxModule'
        """
        fns, optimizer, names, adapter = TorchAdapter.arguments(module, optimizer, inputs, kwargs)
        return cls(fns, loss_fn, optimizer, inputs=names, adapter=adapter, **kwargs)

    @classmethod
    def from_lightning(
        cls,
        module: L.LightningModule,
        *,
        optimizer: optax.GradientTransformation | None = None,
        **kwargs: Any,
    ) -> JaxModule:
        """The team's own ``LightningModule``, unchanged, as the JAX core.

        Its ``training_step`` (forward, torch loss, ``self.log``) and evaluation steps are
        traced by torchax into jitted, sharded steps; ``configure_optimizers`` is mapped onto
        optax with torch's update math; its own hooks run as Lightning runs them. Checkpoints
        keep its layout (``type(module).load_from_checkpoint(path)`` works in plain
        Lightning). See :mod:`torchshell.port` and docs/porting.md.

        Args:
            module: the user's ``LightningModule``.
            optimizer: an optax transform to use instead of ``configure_optimizers``.
            **kwargs: :class:`JaxModule` options (``mesh``, ``sharding``, ...).
        """
        port = LightningPort(module)
        adapter = functools.partial(LightningAdapter, port=port)
        return cls(port.model_fns(), port.loss_fn, optimizer, adapter=adapter, **kwargs)

    # -- what the module does not hold itself: the adapter's hooks (the port: the user's) --
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(...)`` on the host (the port: the user's module, trained weights)."""
        return self.adapter.hooks.forward(self, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """torch's lookup, then the adapter's (the port: the user's module's attributes)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "adapter" not in vars(self):  # (before __init__ set it)
                raise
        return self.adapter.hooks.attribute(self, name)

    @property
    def batch_size(self) -> Any:
        """Lightning's batch size finder's: the port's user module's (else unset until set)."""
        return self.adapter.hooks.attribute(self, "batch_size")

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        self.adapter.hooks.set_attribute(self, "batch_size", value)

    init_state = init_state  # (the state built from a batch's shapes, once)

    # -- training (module._training, ._logging). A loop hook does the module's part, then the
    # adapter's `hooks.run` (the port: the user's hook); those not defined here: `run` alone
    training_step = train_batch  # (the compiled step run, or the batch kept for K per call)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        log, hooks = self.train_log, self.adapter.hooks  # (the wait for data, inline: no call)
        log.wait += time.perf_counter() - log.batch_end if log.batch_end is not None else 0.0
        if hooks.dispatches:  # (-1 from the port's user hook: the epoch ends)
            return hooks.run(self, "on_train_batch_start", batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.train_log.batch_end = time.perf_counter()
        if self.adapter.hooks.dispatches:
            self.adapter.hooks.run(self, "on_train_batch_end", outputs, batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.accumulation.clear()  # (a window never spans epochs: the last batch closes it)
        self.adapter.logs.train_epoch_end(self)  # (the port's epoch means)
        self.adapter.hooks.run(self, "on_train_epoch_end")

    def on_train_end(self) -> None:
        self.train_log.finish()
        self.adapter.logs.last_step_values(self)  # (callback_metrics: the last step's)
        check_finite(self)
        self.adapter.hooks.run(self, "on_train_end")

    @property
    def state(self) -> TrainState | None:
        """The JAX train state, current wherever it is read (buffered batches run first)."""
        if self.windows.buffer:
            run_window(self)
        return self._state

    @state.setter
    def state(self, value: TrainState | None) -> None:
        self._state = value

    @property
    def window_k(self) -> int | None:
        """K chosen by ``steps_per_call="auto"`` (``None`` while measuring; 1 when off)."""
        return self.windows.k

    # -- evaluation (module._evaluation; adapter.evaluation's, found through the hook table)
    def _val_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        return self.adapter.evaluation.validation_step(self, batch, batch_idx, dataloader_idx)

    def _test_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        return self.adapter.evaluation.test_step(self, batch, batch_idx, dataloader_idx)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        return self.adapter.evaluation.predict_step(self, batch, batch_idx, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        eval_epoch_end(self, "val")
        self.adapter.hooks.run(self, "on_validation_epoch_end")

    def on_test_epoch_end(self) -> None:
        eval_epoch_end(self, "test")
        self.adapter.hooks.run(self, "on_test_epoch_end")

    # -- the run: the Trainer's flags, its loaders, the optimizer (module._flags, _run_scope) -
    @property  # type: ignore[override]
    def trainer(self) -> L.Trainer:
        return L.LightningModule.trainer.fget(self)  # type: ignore[attr-defined,no-any-return]

    @trainer.setter
    def trainer(self, trainer: L.Trainer | None) -> None:
        L.LightningModule.trainer.fset(self, trainer)  # type: ignore[attr-defined]
        if trainer is not None and self.run_scope.originals is None:
            attached(self, trainer)

    def setup(self, stage: str) -> None:
        self.run_scope.open()  # (undone in teardown)
        self.adapter.hooks.setup(self, stage)  # (the port: the user's own setup)

    def teardown(self, stage: str) -> None:
        self.adapter.hooks.teardown(self, stage)
        self.run_scope.close(self._trainer)

    def on_train_start(self) -> None:
        self.run_scope.started(self.trainer.train_dataloader)
        self.adapter.optim.on_train_start(self)
        self.adapter.hooks.run(self, "on_train_start")

    def on_validation_start(self) -> None:
        self.run_scope.started(self.trainer.val_dataloaders)
        self.adapter.hooks.run(self, "on_validation_start")

    def on_test_start(self) -> None:
        self.run_scope.started(self.trainer.test_dataloaders)
        self.adapter.hooks.run(self, "on_test_start")

    def on_predict_start(self) -> None:
        self.run_scope.started(self.trainer.predict_dataloaders)
        self.adapter.hooks.run(self, "on_predict_start")

    def configure_optimizers(self) -> Any:
        """What the adapter's optimizer group hands Lightning (:class:`OptaxOptimizer`)."""
        return self.adapter.optim.configure_optimizers(self)

    def optimizer(self) -> optax.GradientTransformation:
        """The optax transform the step applies (the adapter's optimizer group's)."""
        return self.adapter.optim.optimizer(self)  # type: ignore[no-any-return]

    # -- checkpoints and the trained weights (torchshell.module._checkpoint) ---------------
    def on_fit_start(self) -> None:
        fit_start(self)  # (a new fit: a new optimizer state)
        self.adapter.hooks.run(self, "on_fit_start")

    def on_fit_end(self) -> None:
        fit_end(self)  # (the user's torch module holds the trained weights)
        self.adapter.hooks.run(self, "on_fit_end")

    on_save_checkpoint = save
    on_load_checkpoint = load
    restore_from = restore_from

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """The checkpoint's ``state_dict``, as the adapter's checkpoint group reads it."""
        return self.adapter.checkpoint.load_state_dict(self, state_dict, strict, assign)

    def torch_state_dict(self, twin: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The trained weights as a PyTorch ``state_dict`` (strictly checked against ``twin``).

        For a Flax model the params and model state (``batch_stats``, NNX ``BatchStat``) go
        through :func:`bridge.export_state_dict`; for :meth:`from_torch` they already are one.
        """
        if self.state is None:
            raise ConfigError("No trained state yet: run trainer.fit first.")
        return self.adapter.state_dict(self.state, twin)

    @property
    def torch_module(self) -> torch.nn.Module | None:
        """The user's ``nn.Module`` (``from_torch``, ``from_lightning``), else ``None``."""
        return self.adapter.torch_module

    @property
    def transfer_stats(self) -> bridge.TransferStats:
        """Hand-over counts: bytes and copies of the batches given to JAX."""
        return self.placement.stats

    # -- what the adapter groups call back --------------------------------------------------
    @property
    def _compute_dtype(self) -> str | None:
        return self.compute_dtype or self.flags.compute_dtype

    _log_values = log_values
    _outputs_wanted = outputs_wanted
    _step_forward = step_forward
    _sync_user_weights = sync_user_weights
