"""``JaxModule``: a ``LightningModule`` whose compute is a jitted, mesh-sharded JAX step."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import lightning as L
import numpy as np
import optax
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import bridge
import jaxcore
from jaxcore import ModelFns, TrainState
from torchshell.checkpoint import restore_state
from torchshell.summary import param_summary

LossFn = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]


class JaxModule(L.LightningModule):
    """Runs jaxcore train/eval/predict steps inside the real ``lightning.Trainer``.

    Lightning drives the loop (epochs, validation cadence, callbacks, loggers); the batch
    crosses to JAX through :func:`bridge.to_jax` and the step runs jitted on ``mesh``. There
    is no torch optimizer: ``global_step`` counts the JAX optimizer steps. Training metrics
    stay on device and are fetched only on the steps Lightning writes logs.

    Args:
        model: a Flax linen module, or :class:`jaxcore.ModelFns`.
        loss_fn: ``(outputs, batch) -> (loss[B], {name: metric[B]})``.
        optimizer: an optax ``GradientTransformation`` (e.g. :func:`jaxcore.make_optimizer`).
        mesh: the device mesh; every device on one ``data`` axis by default.
        inputs: batch keys a linen module reads.
        seed: seeds the params and the step's rng.
        data_axis: the mesh axis the batch is split over.
        print_summary: print the JAX parameter tree's summary (counts, bytes, sharding)
            when the state is built; Lightning's own summary sees no torch params.

    Example:
        >>> import jaxcore, lightning as L
        >>> from jaxcore.models.digits import MLP
        >>> from torchshell.data.digits import DigitsDataModule
        >>> module = JaxModule(MLP(features=(32,)), jaxcore.softmax_cross_entropy,
        ...                    jaxcore.make_optimizer(lr=1e-2))
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
        data_axis: str = "data",
        print_summary: bool = True,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_fns = (
            model if isinstance(model, ModelFns) else jaxcore.linen_model(model, inputs)
        )
        self.loss_fn = loss_fn
        self.tx = optimizer
        self.mesh = mesh if mesh is not None else jaxcore.make_mesh({data_axis: -1})
        self.seed = seed
        self.data_axis = data_axis
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(data_axis))
        self.state: TrainState | None = None
        self.transfer_stats = bridge.new_stats()
        self._train_step: Callable[..., Any] | None = None
        self._eval_step: Callable[..., Any] | None = None
        self._predict_step: Callable[..., Any] | None = None
        self._eval_sums: dict[str, jax.Array] | None = None
        self._restore_dir: Path | None = None
        self._last_log: tuple[float, int] | None = None
        self.summary = ""
        self.print_summary = print_summary

    # -- state ---------------------------------------------------------------------------
    def _global_rows(self, batch: dict[str, torch.Tensor]) -> int:
        """Rows of the padded global batch: the batch rounded up to the data axis."""
        n = next(iter(batch.values())).shape[0]
        ways = self.mesh.shape[self.data_axis]
        return -(-n // ways) * ways

    def _to_jax(self, batch: dict[str, torch.Tensor], rows: int) -> dict[str, jax.Array]:
        return bridge.to_jax(batch, self.batch_sharding, pad_to=rows, stats=self.transfer_stats)

    def init_state(self, batch: dict[str, torch.Tensor]) -> TrainState:
        """Initialises the train state from a sample batch (shapes only) if not done yet."""
        if self.state is None:
            sample = self._to_jax(batch, self._global_rows(batch))
            state = jaxcore.init_train_state(
                self.model_fns, self.tx, sample, seed=self.seed, mesh=self.mesh
            )
            if self._restore_dir is not None:
                state = restore_state(self._restore_dir, state)
                self._restore_dir = None
            self.state = state
            self._train_rows = self._global_rows(batch)
            self.summary = param_summary(state.params)
            if self.print_summary and (self._trainer is None or self.trainer.is_global_zero):
                print(f"JAX params on mesh {dict(self.mesh.shape)}:\n{self.summary}")
        return self.state

    # -- training ------------------------------------------------------------------------
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        state = self.init_state(batch)
        if self._train_step is None:
            self._train_step = jaxcore.make_train_step(
                self.model_fns,
                self.loss_fn,
                self.tx,
                state_sharding=jaxcore.state_shardings(state),
            )
        self.state, metrics = self._train_step(state, self._to_jax(batch, self._train_rows))
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        if self.trainer._logger_connector.should_update_logs:
            host = jax.device_get(metrics)  # the only sync: on logging steps
            logs = {f"train/{k}": float(v) for k, v in host.items()}
            logs["train/lr"] = float(jaxcore.current_lr(self.state.opt_state))
            now, step = time.perf_counter(), self.trainer.global_step
            if self._last_log is not None and step > self._last_log[1]:
                rate = (step - self._last_log[1]) / (now - self._last_log[0])
                logs["perf/steps_per_s"] = rate
                logs["perf/samples_per_s"] = rate * self._train_rows
            self._last_log = (now, step)
            self.log_dict(logs, prog_bar=True)

    # -- evaluation ----------------------------------------------------------------------
    def _eval(self, batch: dict[str, torch.Tensor]) -> None:
        state = self.init_state(batch)
        if self._eval_step is None:
            self._eval_step = jaxcore.make_eval_step(self.model_fns, self.loss_fn)
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

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval(batch)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval(batch)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        state = self.init_state(batch)
        if self._predict_step is None:
            self._predict_step = jaxcore.make_predict_step(self.model_fns)
        n = next(iter(batch.values())).shape[0]
        outputs = self._predict_step(state, self._to_jax(batch, self._global_rows(batch)))
        return bridge.to_torch(outputs)[:n]

    # -- checkpoints (the files themselves: torchshell.checkpoint.OrbaxCheckpointIO) ---------
    def restore_from(self, directory: Path) -> None:
        """Restores the JAX state from an Orbax directory when the state is (re)built."""
        if self.state is not None:
            self.state = restore_state(directory, self.state)
        else:
            self._restore_dir = directory

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        np_state = np.random.get_state()
        checkpoint["coreshell_rng"] = {
            "torch": torch.get_rng_state(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
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
