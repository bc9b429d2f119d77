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

import jaxcore
from jaxcore import ModelFns, TrainState
from torchshell._errors import ConfigError
from torchshell.adapters import Adapter, FlaxAdapter, Placement, TorchAdapter
from torchshell.adapters._base import input_names, model_functions, step_loss
from torchshell.adapters._batches import float_fields, positional_keys
from torchshell.adapters._logs import TrainLog
from torchshell.module._accumulation import Accumulation
from torchshell.module._checkpoint import CheckpointPart, Held
from torchshell.module._compiled import Compiled
from torchshell.module._evaluation import Evaluation, EvaluationPart
from torchshell.module._flags import TrainerFlags
from torchshell.module._parts import TrainerFlagsPart
from torchshell.module._run_scope import RunScope
from torchshell.module._train_parts import StepPart, TrainLogPart
from torchshell.module._windows import Windows, resolve_steps_per_call
from torchshell.optim import map_configure_optimizers
from torchshell.port import LightningAdapter, LightningPort
from torchshell.summary import param_summary

LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]
Batch = Mapping[str, torch.Tensor]


class JaxModule(
    StepPart,
    TrainLogPart,
    TrainerFlagsPart,
    EvaluationPart,
    CheckpointPart,
):
    """Runs jaxcore train/eval/predict steps inside the real ``lightning.Trainer``.

    Lightning drives the loop (epochs, validation cadence, callbacks, loggers); each batch
    crosses to JAX through :func:`bridge.to_jax` (zero-copy where the layout allows, ragged
    batches padded with a ``mask``) and the step runs jitted and sharded on ``mesh``. There is
    no torch optimizer: ``global_step`` counts JAX optimizer steps. By default a short step's
    batches are buffered and run K per jitted call (:mod:`torchshell.module._windows`: the K=1
    meaning of ``global_step``, logging and checkpoints kept). With ``steps_per_call=K`` a
    DataLoader batch of ``K * B`` rows is viewed as K batches in one call. Metrics stay on
    device and are fetched every ``log_every_n_steps`` steps (loggers, bar, callbacks).

    Batches come as the DataLoader yields them: a dict of tensors, or a list/tuple (a
    ``TensorDataset``) whose positions ``batch_keys`` names (``x``, ``y`` by default).
    The Trainer's ``precision``, ``accumulate_grad_batches`` and ``gradient_clip_val`` are
    carried out in the JAX step (see :mod:`torchshell.module._flags`).

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
        steps_per_call: ``"auto"`` (K batches per call, K measured) or an int K (a batch of
            K * B rows viewed as K steps).
        accum_steps: micro-batches per optimizer step (gradient accumulation within a batch).
        compute_dtype: ``"float32"`` or ``"bfloat16"`` for the forward/backward pass.
        nan_policy: ``"stop"``, ``"skip"`` or ``"none"`` (see :mod:`jaxcore.guard`).
        hlo_dump_dir: write the train step's jaxpr/StableHLO/HLO here at its first compile.
        print_summary: print the JAX parameter tree's summary (counts, bytes, sharding)
            when the state is built; Lightning's own summary sees no torch params.
        adapter: ``(model_fns, placement) -> Adapter``: how the model came in (``from_torch``
            and ``from_lightning`` pass theirs); a :class:`FlaxAdapter` by default.

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
        if accum_steps < 1:
            raise ConfigError(
                f"accum_steps must be >= 1, got {accum_steps}. Fix: use 1 to turn it off."
            )
        self.windows = Windows(auto)  # K batches per call (see module._windows)
        self.evaluation = Evaluation()  # its steps and epoch sums (module._evaluation)
        self._last_metrics: dict[str, jax.Array] = {}
        self.automatic_optimization = False
        self.batch_keys = tuple(batch_keys)
        names = input_names(inputs, self.batch_keys)
        nnx_model = isinstance(model, nnx.Module)
        self.model_fns = model_functions(model, names)
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer={type(optimizer).__name__}(...): a torch optimizer is mapped onto "
                "the torch module's own parameters. Fix: JaxModule.from_torch(module, loss, "
                "optimizer) or from_lightning, or an optax transform here "
                "(jaxcore.make_optimizer('adamw', lr=...))."
            )
        self.tx = optimizer
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
        self.train_log = TrainLog(self._emit)
        self._wants_outputs: tuple[Any, bool] = (None, False)  # (trainer, callbacks): wanted
        self.run_scope = RunScope()  # what a run changes (flags, loaders), undone at its end
        self.adapter.hooks.attach(self)  # (the port: the user's hooks and loaders)

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
        state; ``module`` itself is not changed by training: :meth:`torch_state_dict` gives
        the trained ``state_dict``, which ``module.load_state_dict(..., strict=True)`` takes.

        Args:
            module: the team's ``nn.Module``.
            loss_fn: a torch loss (``nn.CrossEntropyLoss()``, ``F.mse_loss``: run by torchax
                in the step, its ``reduction="mean"`` reproduced exactly over the real rows;
                see :mod:`torchshell.trace._loss`) or a JAX ``loss_fn(outputs, batch)``.
            optimizer: a ``torch.optim`` optimizer over ``module.parameters()`` (SGD, Adam,
                AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam with torch's update math and
                param groups) or an optax transform.
            inputs: the batch fields (or tuple positions) fed to ``module.forward``. Given
                as positions of a tuple batch without ``batch_keys``, the position after the
                last input is the loss's target ``y``: ``inputs=(0, 1)`` on a
                ``TensorDataset(ids, mask, labels)``.
            **kwargs: :class:`JaxModule` options.

        Example:
            >>> net = torch.nn.Linear(4, 3)
            >>> jm = JaxModule.from_torch(net, torch.nn.CrossEntropyLoss(),
            ...                           torch.optim.SGD(net.parameters(), lr=0.1),
            ...                           print_summary=False)
            >>> type(jm).__name__
            'JaxModule'
        """
        from torchshell.torch_model import torch_model_fns

        if isinstance(optimizer, torch.optim.Optimizer):  # torch's update math, its groups
            trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
            optimizer = map_configure_optimizers(
                optimizer, trainable, steps_per_epoch=None, total_steps=1
            ).tx
        positions = [i for i in inputs if isinstance(i, int)]
        if "batch_keys" not in kwargs and len(positions) == len(inputs):
            kwargs["batch_keys"] = positional_keys(positions)  # (ids, mask, label): (0, 1)
        keys = tuple(kwargs.get("batch_keys", ("x", "y")))
        names = [keys[i] if isinstance(i, int) else i for i in inputs]
        adapter = functools.partial(TorchAdapter, batch_keys=keys, torch_module=module)
        fns = torch_model_fns(module, names)
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

        Its ``training_step`` (forward, torch loss, ``self.log``) is traced by torchax into
        the jitted, sharded step; ``validation_step``/``test_step``/``predict_step`` the same
        way for the eval loops; ``configure_optimizers`` is mapped onto optax with torch's
        update math. Checkpoints hold the trained weights in the module's own layout, so
        ``type(module).load_from_checkpoint(path)`` works in plain Lightning. See
        :mod:`torchshell.port` and docs/porting.md.

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
        """What Lightning's batch size finder reads and sets: the port's user module's own
        ``batch_size``; missing (``hasattr`` false) until set otherwise."""
        return self.adapter.hooks.attribute(self, "batch_size")

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        self.adapter.hooks.set_attribute(self, "batch_size", value)

    def init_state(self, batch: Any) -> TrainState:
        """Builds the train state from a sample batch (shapes only) on first use."""
        if self.state is None:
            pending, self.compiled.pending = self.compiled.pending or self._start_state(batch), None
            state = pending.result()
            self.state = state = self.held.apply(state)
            self.adapter.planned(batch)
            self.summary = param_summary(state.params)
            if self.print_summary and (self._trainer is None or self.trainer.is_global_zero):
                print(f"JAX params on mesh {dict(self.mesh.shape)}:\n{self.summary}")
            self.state = self.adapter.checkpoint.restored(self, state)  # (the user's layout)
        return self.state

    # -- training ------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor] | None:
        """Runs the compiled step (or buffers the batch, see :mod:`torchshell.module._windows`).

        Returns ``{"loss": loss}`` (waiting for the step) only when a user callback reads
        ``on_train_batch_end``'s outputs, as plain Lightning gives them; else ``None``, so the
        loop never waits for the device.
        """
        with self.adapter.steps.counted(self):  # (the port's manual optimization)
            self.adapter.checkpoint.before_step(self)  # (the port: host code's in-place changes)
            t0 = time.perf_counter()
            raw, batch = batch, self.adapter.prepare(batch)
            if self._float_fields is None:  # (NaN/Inf in them: refused inside the step)
                self._float_fields = float_fields(batch)
            m = self.flags.accumulate
            if m == 1 and self.windows.buffering():
                metrics = self._buffer_batch(batch)
                every = max(self.trainer.log_every_n_steps, 1)  # type: ignore[attr-defined]
                if metrics is not None and self.trainer.global_step % every == 0:
                    self._queue_log(metrics, self.adapter.global_rows(batch))
                self.train_log.compute += time.perf_counter() - t0
                return None  # (windows: no callback reads the outputs, see _outputs_wanted)
            if m > 1:
                if self.steps_per_call > 1 or self.accum_steps > 1:
                    raise ConfigError(
                        f"accumulate_grad_batches={m} with steps_per_call={self.steps_per_call} "
                        f"and accum_steps={self.accum_steps}: choose one way to group steps. Fix: "
                        "keep accumulate_grad_batches and set the other two to 1."
                    )
                ahead = self.adapter.hooks.outputs_ahead(
                    self, batch, len(self.accumulation.batches), raw
                )
                window = self._window_batch(batch)
                if window is None:
                    self.train_log.compute += time.perf_counter() - t0
                    return ahead
                jbatch, one, rows_, micro = window
                steps = 1
            else:
                jbatch, one, rows_ = self.adapter.one_step_view(batch, self.steps_per_call)
                micro, steps = self.accum_steps, self.steps_per_call
                ahead = self.adapter.hooks.outputs_ahead(self, batch, 0, raw)
            if self._state is None and self.compiled.train is None and m == 1:
                self._compile_beside_init(one, micro, jbatch)
            self.init_state(one)
            step_fn = self.adapter.steps.step_for(self, micro, jbatch)
            before = self.trainer.global_step
            with self.adapter.checked(one):
                if self.windows.measuring(self._windowable):
                    self._state, metrics = self.windows.timed(step_fn, self._state, jbatch)
                    if (times := self.windows.timings()) is not None:
                        self._choose_k(times, jbatch, one)
                else:
                    self._state, metrics = step_fn(self._state, jbatch)
            if self.compiled.stats_due and self.compiled.stats is not None:
                self.compiled.stats_due = False
                self._log_to_loggers(
                    {f"compile/{k_}": v for k_, v in self.compiled.stats.as_dict().items()}
                )
            progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
            for _ in range(steps):
                progress.increment_ready()
                progress.increment_completed()
            self._last_metrics = metrics
            self.adapter.logs.after_step(self, metrics, rows_ * (micro if m > 1 else 1))
            self.train_log.compute += time.perf_counter() - t0
            if self._logging_step(before):
                self._queue_log(metrics, rows_ * (micro if m > 1 else 1))
            return ahead if ahead is not None else self._outputs(metrics)

    # -- K batches per call (steps_per_call="auto", see torchshell.module._windows) -----------
    @property
    def state(self) -> TrainState | None:
        """The JAX train state; batches still buffered for a window run first."""
        if self.windows.buffer:
            self._run_window()
        return self._state

    @state.setter
    def state(self, value: TrainState | None) -> None:
        self._state = value
