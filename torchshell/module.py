"""``JaxModule``: a ``LightningModule`` whose compute is a jitted, mesh-sharded JAX step."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import lightning as L
import numpy as np
import optax
import torch
from flax.errors import FlaxError
from jax.sharding import Mesh

import bridge
import jaxcore
from jaxcore import ModelFns, TrainState
from torchshell._errors import ConfigError
from torchshell.checkpoint import restore_state
from torchshell.summary import param_summary


def _signature(batch: Batch) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape and dtype of every field (what a compiled step is specialised on)."""
    return {name: (tuple(t.shape[1:]), t.dtype) for name, t in batch.items()}


LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]
Batch = Mapping[str, torch.Tensor]


class JaxModule(L.LightningModule):
    """Runs jaxcore train/eval/predict steps inside the real ``lightning.Trainer``.

    Lightning drives the loop (epochs, validation cadence, callbacks, loggers); each batch
    crosses to JAX through :func:`bridge.to_jax` (zero-copy where the layout allows, ragged
    batches padded with a ``mask``) and the step runs jitted and sharded on ``mesh``. There is
    no torch optimizer: ``global_step`` counts JAX optimizer steps. With ``steps_per_call=K``
    one Lightning step hands over a DataLoader batch of ``K * B`` rows, viewed as ``[K, B, ...]``
    (no copy), and runs K optimizer steps in one call, so Lightning's per-step cost is paid once
    per K steps. Metrics stay on device and are fetched only every ``log_every_n_steps``
    optimizer steps, where they go to the loggers, the progress bar and the callbacks.

    Args:
        model: a Flax linen module, or :class:`jaxcore.ModelFns`.
        loss_fn: ``(outputs, batch) -> (loss[B], {name: metric[B]})``.
        optimizer: an optax ``GradientTransformation`` (e.g. :func:`jaxcore.make_optimizer`).
        mesh: the device mesh; every device on one ``data`` axis by default.
        inputs: batch keys a linen module reads.
        seed: seeds the params and the step's rng.
        sharding: a partition preset of :data:`jaxcore.PRESETS` (``dp``, ``fsdp``, ``tp``...).
        rules: explicit ``[(regex, PartitionSpec)]`` rules tried before the preset's.
        data_axis: the mesh axis the batch is split over.
        model_axis: the tensor-parallel mesh axis.
        steps_per_call: optimizer steps per Lightning step (K stacked batches in one call).
        accum_steps: micro-batches per optimizer step (gradient accumulation).
        compute_dtype: ``"float32"`` or ``"bfloat16"`` for the forward/backward pass.
        nan_policy: ``"stop"``, ``"skip"`` or ``"none"`` (see :mod:`jaxcore.guard`).
        hlo_dump_dir: write the train step's jaxpr/StableHLO/HLO here at its first compile.
        print_summary: print the JAX parameter tree's summary (counts, bytes, sharding)
            when the state is built; Lightning's own summary sees no torch params.

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
        model: nn.Module | ModelFns,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh | None = None,
        inputs: Sequence[str] = ("x",),
        seed: int = 0,
        sharding: str | None = "dp",
        rules: Sequence[Any] | None = None,
        data_axis: str = "data",
        model_axis: str = "model",
        steps_per_call: int = 1,
        accum_steps: int = 1,
        compute_dtype: str | None = None,
        nan_policy: str = "stop",
        hlo_dump_dir: str | Path | None = None,
        print_summary: bool = True,
    ) -> None:
        super().__init__()
        if steps_per_call < 1 or accum_steps < 1:
            raise ConfigError(
                f"steps_per_call and accum_steps must be >= 1, got {steps_per_call} and "
                f"{accum_steps}. Fix: use 1 to turn either off."
            )
        self.automatic_optimization = False
        self.model_fns = (
            model if isinstance(model, ModelFns) else jaxcore.linen_model(model, inputs)
        )
        self.loss_fn = loss_fn
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
        self.batch_sharding = jaxcore.batch_sharding(self.mesh, data_axis=data_axis)
        self.stacked_sharding = jaxcore.batch_sharding(
            self.mesh, data_axis=data_axis, steps_per_call=steps_per_call
        )
        self.state: TrainState | None = None
        self.torch_module: torch.nn.Module | None = None
        self.transfer_stats = bridge.new_stats()
        self.compile_stats: jaxcore.CompileStats | None = None
        self.summary = ""
        self._train_step: jaxcore.Step | None = None
        self._eval_step: jaxcore.Step | None = None
        self._predict_step: jaxcore.Step | None = None
        self._eval_sums: dict[str, jax.Array] | None = None
        self._restore_dir: Path | None = None
        self._last_log: tuple[float, int] | None = None
        self._wait = 0.0  # seconds spent waiting for data since the last log
        self._compute = 0.0  # seconds in the bridge + step dispatch since the last log
        self._batch_end: float | None = None
        self._pending: tuple[dict[str, jax.Array], dict[str, float], int] | None = None
        self._fields: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    @classmethod
    def from_torch(
        cls,
        module: torch.nn.Module,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        inputs: Sequence[str] = ("x",),
        **kwargs: Any,
    ) -> JaxModule:
        """A :class:`JaxModule` training a team's own ``nn.Module``, traced by torchax.

        Its weights are the params (keyed by ``state_dict`` names), its buffers the model
        state; ``module`` itself is not changed by training: :meth:`torch_state_dict` gives
        the trained ``state_dict``, which ``module.load_state_dict(..., strict=True)`` takes.
        """
        from torchshell.torch_model import torch_model_fns

        jm = cls(torch_model_fns(module, inputs), loss_fn, optimizer, inputs=inputs, **kwargs)
        object.__setattr__(jm, "torch_module", module)  # not a submodule: no torch params
        return jm

    def torch_state_dict(self, twin: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The trained weights as a PyTorch ``state_dict`` (strictly checked against ``twin``).

        For a Flax model the params and model state (e.g. ``batch_stats``) go through
        :func:`bridge.export_state_dict`; for :meth:`from_torch` modules they already are one.
        """
        if self.state is None:
            raise ConfigError("No trained state yet: run trainer.fit first.")
        if self.torch_module is not None:
            from torchshell.torch_model import params_to_state_dict

            return params_to_state_dict(
                self.state.params, self.state.model_state, self.torch_module
            )
        return bridge.export_state_dict(
            {"params": self.state.params, **self.state.model_state}, twin
        )

    # -- state ---------------------------------------------------------------------------
    def _global_rows(self, batch: Batch) -> int:
        """Rows of the padded global batch: the batch rounded up to the data axis."""
        n = next(iter(batch.values())).shape[0]
        ways = self.mesh.shape[self.data_axis]
        return -(-n // ways) * ways

    def _to_jax(self, batch: Batch, rows: int) -> dict[str, jax.Array]:
        return bridge.to_jax(batch, self.batch_sharding, pad_to=rows, stats=self.transfer_stats)

    def _stacked(self, batch: Batch) -> dict[str, jax.Array]:
        """A ``K * B``-row batch viewed as ``[K, B, ...]`` (no copy) and handed over."""
        k = self.steps_per_call
        n = next(iter(batch.values())).shape[0]
        ways = self.mesh.shape[self.data_axis]
        if n % k or (n // k) % ways:
            raise ConfigError(
                f"steps_per_call={k} needs training batches of K*B rows with B divisible by "
                f"the data axis ({ways}), got {n} rows. Fix: set the DataLoader batch size "
                f"to {k} x (a multiple of {ways}) and drop_last=True for training."
            )
        views = {name: t.view(k, n // k, *t.shape[1:]) for name, t in batch.items()}
        return bridge.to_jax(views, self.stacked_sharding, stats=self.transfer_stats)

    def init_state(self, batch: Batch) -> TrainState:
        """Builds the train state from a sample batch (shapes only) on first use."""
        if self.state is None:
            sample = self._to_jax(batch, self._global_rows(batch))
            state = jaxcore.init_train_state(
                self.model_fns,
                self.tx,
                sample,
                seed=self.seed,
                mesh=self.mesh,
                param_shardings=self.shard_fn,
            )
            if self._restore_dir is not None:
                state = restore_state(self._restore_dir, state)
                self._restore_dir = None
            self.state = state
            self._fields = _signature(batch)
            self.summary = param_summary(state.params)
            if self.print_summary and (self._trainer is None or self.trainer.is_global_zero):
                print(f"JAX params on mesh {dict(self.mesh.shape)}:\n{self.summary}")
        return self.state

    # -- training ------------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._batch_end is not None:
            self._wait += time.perf_counter() - self._batch_end

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch_end = time.perf_counter()

    def training_step(self, batch: Batch, batch_idx: int) -> None:
        t0 = time.perf_counter()
        k = self.steps_per_call
        if k == 1:
            jbatch = self._to_jax(batch, self._global_rows(batch))
            self.init_state(batch)
        else:
            jbatch = self._stacked(batch)
            n = next(iter(batch.values())).shape[0] // k
            self.init_state({name: t[:n] for name, t in batch.items()})
        assert self.state is not None
        if self._train_step is None:
            self._train_step = jaxcore.make_train_step(
                self.model_fns,
                self.loss_fn,
                self.tx,
                state_sharding=jaxcore.state_shardings(self.state),
                batch_sharding=self.stacked_sharding,
                steps_per_call=k,
                accum_steps=self.accum_steps,
                compute_dtype=self.compute_dtype,
                nan_policy=self.nan_policy,
            )
            self.compile_stats = self._train_step.compile(
                self.state, jbatch, dump_dir=self.hlo_dump_dir
            )
            self._log_to_loggers(
                {f"compile/{k_}": v for k_, v in self.compile_stats.as_dict().items()}
            )
        before = self.trainer.global_step
        with self._naming_fields(batch):
            self.state, metrics = self._train_step(self.state, jbatch)
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        for _ in range(k):
            progress.increment_ready()
            progress.increment_completed()
        self._compute += time.perf_counter() - t0
        every = max(self.trainer.log_every_n_steps, 1)  # type: ignore[attr-defined]
        if self.trainer.global_step // every > before // every:
            self._queue_log(metrics, rows=jbatch[next(iter(jbatch))].shape[k > 1])

    @contextlib.contextmanager
    def _naming_fields(self, batch: Batch) -> Iterator[None]:
        """Turns a trace-time failure on a changed batch into an error naming the field."""
        try:
            yield
        except (TypeError, ValueError, FlaxError) as err:
            got = _signature(batch)
            diff = [
                f"{name!r}: expected per-row shape {want[0]} {want[1]}, got "
                + (f"{got[name][0]} {got[name][1]}" if name in got else "no such field")
                for name, want in self._fields.items()
                if got.get(name) != want
            ]
            if not diff:
                raise
            raise jaxcore.BatchError(
                "The batch no longer matches the one the model was built from: "
                + "; ".join(diff)
                + ". Fix: keep every field's per-row shape and dtype fixed "
                "(pad variable lengths to buckets in the collate)."
            ) from err

    def _log_to_loggers(self, metrics: dict[str, float]) -> None:
        if self._trainer is not None:
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.trainer.global_step)

    def _queue_log(self, metrics: dict[str, jax.Array], rows: int) -> None:
        """Starts copying this logging step's metrics to the host and logs the previous ones.

        Logging one interval late means the fetch never waits for the device: the values of
        the previous logging step are long computed (the last ones are logged at train end).
        """
        assert self.state is not None
        extra: dict[str, Any] = {"train/lr": jaxcore.current_lr(self.state.opt_state)}
        if self.nan_policy != "none":
            extra["train/nonfinite_steps"] = self.state.nonfinite
        values = {
            **{f"train/{k}": v for k, v in metrics.items()},
            **{k: jnp.array(v) for k, v in extra.items()},
        }  # copies: the state is donated
        for value in values.values():
            value.copy_to_host_async()
        if self._pending is not None:
            self._log_train(*self._pending)
        self._pending = (values, self._perf(rows), self.trainer.global_step)

    def _perf(self, rows: int) -> dict[str, float]:
        """Host-side throughput since the last logging step, measured now (not when logged)."""
        now, step = time.perf_counter(), self.trainer.global_step
        perf = {}
        if self._last_log is not None and step > self._last_log[1]:
            elapsed = now - self._last_log[0]
            rate = (step - self._last_log[1]) / elapsed
            perf = {
                "perf/steps_per_s": rate,
                "perf/samples_per_s": rate * rows,
                "perf/data_wait_fraction": min(self._wait / elapsed, 1.0),
                "perf/step_fraction": min(self._compute / elapsed, 1.0),
            }
        self._last_log, self._wait, self._compute = (now, step), 0.0, 0.0
        return perf

    def _log_train(
        self,
        values: dict[str, jax.Array],
        perf: dict[str, float],
        step: int,
        progress_bar: bool = True,
    ) -> None:
        """Logs one logging step's metrics (already on their way to the host)."""
        logs = {k: float(np.asarray(v).reshape(-1)[-1]) for k, v in jax.device_get(values).items()}
        logs |= perf
        logs |= {f"bridge/{k}": v for k, v in self.transfer_stats.as_metrics().items()}
        if self._train_step is not None:
            logs["compile/recompiles"] = float(self._train_step.recompiles)
        if self._trainer is not None:
            for logger in self.loggers:
                logger.log_metrics(logs, step=step)
        # Callbacks read trainer.callback_metrics; LightningModule.log costs ~0.8 ms a value
        # (measured), so the values go there directly and only the loss through self.log.
        self.trainer.callback_metrics.update({k: torch.tensor(v) for k, v in logs.items()})
        if progress_bar:  # (not allowed in on_train_end)
            self.log("loss", logs["train/loss"], prog_bar=True, logger=False)
            if "perf/samples_per_s" in logs:
                self.log("samples/s", logs["perf/samples_per_s"], prog_bar=True, logger=False)
        if logs.get("train/nonfinite_steps", 0.0) and self.nan_policy == "stop":
            jaxcore.check_finite(self.state)

    def on_train_end(self) -> None:
        if self._pending is not None:
            self._log_train(*self._pending, progress_bar=False)
            self._pending = None
        if self.state is not None and self.nan_policy == "stop":
            jaxcore.check_finite(self.state)

    # -- evaluation ----------------------------------------------------------------------
    def _eval(self, batch: Batch) -> None:
        state = self.init_state(batch)
        if self._eval_step is None:
            self._eval_step = jaxcore.make_eval_step(
                self.model_fns,
                self.loss_fn,
                state_sharding=jaxcore.state_shardings(state),
                batch_sharding=self.batch_sharding,
                compute_dtype=self.compute_dtype,
            )
        with self._naming_fields(batch):
            sums = self._eval_step(state, self._to_jax(batch, self._global_rows(batch)))
        self._eval_sums = (
            sums
            if self._eval_sums is None
            else jax.tree.map(lambda a, b: a + b, self._eval_sums, sums)
        )

    def _eval_epoch_end(self, prefix: str) -> None:
        if self._eval_sums is None:
            return
        sums = jax.device_get(self._eval_sums)
        self._eval_sums = None
        count = float(sums.pop("count"))
        self.log_dict(
            {f"{prefix}/{k}": float(v) / count for k, v in sums.items()}, prog_bar=prefix == "val"
        )

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._eval(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def predict_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        state = self.init_state(batch)
        if self._predict_step is None:
            self._predict_step = jaxcore.make_predict_step(
                self.model_fns, compute_dtype=self.compute_dtype
            )
        n = next(iter(batch.values())).shape[0]
        outputs = self._predict_step(state, self._to_jax(batch, self._global_rows(batch)))
        return bridge.to_torch(outputs)[:n]  # type: ignore[no-any-return]

    # -- checkpoints (the files themselves: torchshell.checkpoint.OrbaxCheckpointIO) ---------
    def restore_from(self, directory: Path) -> None:
        """Restores the JAX state from an Orbax directory when the state is (re)built."""
        if self.state is not None:
            self.state = restore_state(directory, self.state)
        else:
            self._restore_dir = directory

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        name, keys, *rest = np.random.get_state()
        checkpoint["coreshell_rng"] = {
            "torch": torch.get_rng_state(),
            "numpy": [name, torch.from_numpy(np.asarray(keys).astype(np.int64)), *rest],
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        rng = checkpoint.get("coreshell_rng")
        if rng is None:
            return
        torch.set_rng_state(rng["torch"])
        name, keys, *rest = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))

    def configure_optimizers(self) -> None:
        """No torch optimizer: the optax optimizer runs inside the JAX step."""
        return None
