"""The Flax and torch adapters' ``evaluation`` group: the loss function's exact masked means."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

import bridge
import jaxcore
from jaxcore.guard import raise_failed
from torchshell.adapters._batches import rows

__all__ = ["EvalHooks", "eval_loader"]


def eval_loader(trainer: Any, dataloader_idx: int | None) -> Any:
    """The DataLoader of the running validation/test pass that ``dataloader_idx`` names
    (Lightning's order of the flattened loaders), or ``None`` without a Trainer."""
    if trainer is None:
        return None
    fn = trainer.state.fn  # (the stage says "validating" inside fit too)
    if fn == TrainerFn.TESTING:
        loop = trainer.test_loop
    elif fn == TrainerFn.VALIDATING:
        loop = trainer.validate_loop
    else:  # validation inside fit, the sanity check included
        loop = trainer.fit_loop.epoch_loop.val_loop
    combined = loop._combined_loader
    if combined is None:
        return None
    loaders = combined.flattened
    idx = dataloader_idx or 0
    return loaders[idx] if idx < len(loaders) else None


class EvalHooks:
    """What the evaluation hooks run: the Flax and torch adapters' ``evaluation``.

    The model's loss function over each batch, added up on device as exact masked sums of
    the module's :class:`Evaluation` (logged as means at the epoch's end), and the model's
    outputs for prediction. Each method receives the :class:`~torchshell.module.JaxModule`
    whose Lightning hook of the same name calls it, and returns what that hook returns.
    """

    def validation_step(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> None:
        """One validation batch's masked sums, added to its loader's epoch; returns nothing."""
        self._add_sums(module, batch, batch_idx, dataloader_idx)

    def test_step(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> None:
        """One test batch's masked sums, added to its loader's epoch; returns nothing."""
        self._add_sums(module, batch, batch_idx, dataloader_idx)

    def predict_step(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> Any:
        """The model's outputs for the batch's real rows, as torch tensors."""
        batch = module.adapter.prepare(batch)
        state = module.init_state(batch)
        ev = module.evaluation
        if ev.predict_step is None:
            ev.predict_step = jaxcore.make_predict_step(
                module.model_fns, compute_dtype=module._compute_dtype, input_checks=True
            )
        n = rows(batch)
        outputs, check = ev.predict_step(state, module.adapter.to_jax(batch, train=False))
        raise_failed(check, "in a predict batch")  # (the outputs come to the host anyway)
        return bridge.to_torch(outputs)[:n]

    def _add_sums(
        self, module: Any, batch: Any, batch_idx: int, dataloader_idx: int | None
    ) -> None:
        ev, adapter = module.evaluation, module.adapter
        batch = adapter.prepare(batch)
        batch = ev.unrepeated(
            batch, batch_idx, dataloader_idx, lambda: eval_loader(module._trainer, dataloader_idx)
        )
        state = module.init_state(batch)
        if ev.step is None:
            ev.step = jaxcore.make_eval_step(
                module.model_fns,
                module.loss_fn,
                state_sharding=jaxcore.state_shardings(state),
                batch_sharding=None,  # the arrays' own (placed leaf by leaf by the bridge)
                compute_dtype=module._compute_dtype,
                input_checks=True,
                weigh_rows=adapter.weigh_rows,  # (False: a graph batch weighs one)
            )
        with adapter.checked(batch):
            sums, check = ev.step(state, adapter.to_jax(batch, train=False))
        ev.add(sums, check, dataloader_idx)
