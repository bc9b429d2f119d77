"""JaxModule's evaluation part: exact masked validation/test means, and prediction."""

from __future__ import annotations

from typing import Any

import jax

import bridge
import jaxcore
from torchshell._batches import rows
from torchshell._module_parts import _Shared

__all__ = ["EvaluationPart"]


class EvaluationPart(_Shared):
    # -- evaluation ----------------------------------------------------------------------
    def _eval(self, batch: Any, dataloader_idx: int | None) -> None:
        batch = self._prepare(batch)
        state = self.init_state(batch)
        if self._eval_step is None:
            self._eval_step = jaxcore.make_eval_step(
                self.model_fns,
                self.loss_fn,
                state_sharding=jaxcore.state_shardings(state),
                batch_sharding=self.batch_sharding,
                compute_dtype=self._compute_dtype,
            )
        with self._batch_check(batch):
            sums = self._eval_step(state, self._static(self._to_jax(batch), False))
        before = self._eval_sums.get(dataloader_idx)
        self._eval_sums[dataloader_idx] = (
            sums if before is None else jax.tree.map(lambda a, b: a + b, before, sums)
        )

    def _eval_epoch_end(self, prefix: str) -> None:
        """Exact epoch means per loader: ``val/loss``, or with several loaders Lightning's
        ``val/loss/dataloader_idx_N``."""
        every, self._eval_sums = jax.device_get(self._eval_sums), {}
        for idx, sums in every.items():
            count = float(sums.pop("count"))
            suffix = "" if idx is None else f"/dataloader_idx_{idx}"
            self.log_dict(
                {f"{prefix}/{k}{suffix}": float(v) / count for k, v in sums.items()},
                prog_bar=prefix == "val",
                add_dataloader_idx=False,  # (named here: epoch-end hooks have no loader)
            )

    # ``dataloader_idx``: passed by Lightning with several loaders only.
    def validation_step(
        self, batch: Any, batch_idx: int, dataloader_idx: int | None = None
    ) -> None:
        self._eval(batch, dataloader_idx)

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> None:
        self._eval(batch, dataloader_idx)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int | None = None) -> Any:
        batch = self._prepare(batch)
        state = self.init_state(batch)
        if self._predict_step is None:
            self._predict_step = jaxcore.make_predict_step(
                self.model_fns, compute_dtype=self._compute_dtype
            )
        n = rows(batch)
        outputs = self._predict_step(state, self._static(self._to_jax(batch), False))
        return bridge.to_torch(outputs)[:n]
