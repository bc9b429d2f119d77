"""A :class:`~torchshell.module.JaxModule`'s evaluation: exact masked validation/test means.

Across JAX processes each evaluation step is one collective over the global batch: every
process hands over its own rows (its share of a loader that a ``DistributedSampler`` splits,
see :func:`torchshell.data.eval_shard`), and the step's masked sums and ``count`` cover the
rows of all processes. The rows such a sampler repeats to even out the shards are masked
here, so the epoch means are those of one process over the same rows.

What Lightning's ``validation_step``/``test_step``/``predict_step`` run is the adapter's
(``adapter.evaluation``): :class:`EvalHooks` for the Flax and torch paths, the port's
``LightningEvaluation`` (:mod:`torchshell.port._user`, the user's own hooks traced).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch

import jaxcore
from jaxcore.guard import first_failed, raise_failed
from torchshell.adapters._batches import rows
from torchshell.data._sampler import real_rows, shard_sampler

# The JaxModule these functions serve, by name only: _jax_module imports this file, and an
# import back (even for type checking) would close a cycle.
JaxModule = Any

__all__ = ["Evaluation", "eval_epoch_end"]


class Evaluation:
    """One module's evaluation: its compiled steps, and per loader the masked sums of an epoch
    (exact means over the real rows), the first failed input check, the rows seen.

    Example:
        >>> ev = Evaluation()
        >>> ev.add({"loss": jnp.float32(3.0), "count": jnp.float32(2.0)}, None, None)
        >>> ev.epoch_means("in a validation batch")
        {None: {'loss': 1.5}}
    """

    def __init__(self) -> None:
        self.step: jaxcore.Step | None = None
        self.predict_step: jaxcore.Step | None = None
        self._sums: dict[int | None, dict[str, jax.Array]] = {}
        self._check: Any = None
        self._shards: dict[int | None, list[Any]] = {}  # a loader's real rows, seen

    def add(self, sums: dict[str, jax.Array], check: Any, idx: int | None) -> None:
        """Adds one batch's masked sums (and its input check) to loader ``idx``'s epoch."""
        if check is not None:
            self._check = check if self._check is None else first_failed(self._check, check)
        before = self._sums.get(idx)
        self._sums[idx] = sums if before is None else jax.tree.map(jnp.add, before, sums)

    def epoch_means(self, where: str) -> dict[int | None, dict[str, float]]:
        """The epoch's means per loader (the sums divided by ``count``); starts a new epoch.

        Raises:
            BatchError: an input check failed in a batch (``where`` says which kind).
        """
        check, self._check = self._check, None
        if check is not None:  # ids past an embedding table (torch: IndexError)
            raise_failed(check, where)
        every, self._sums = jax.device_get(self._sums), {}
        means = {}
        for idx, sums in every.items():
            count = float(sums.pop("count"))
            means[idx] = {k: float(v) / count for k, v in sums.items()}
        return means

    def unrepeated(
        self, batch: Any, batch_idx: int, idx: int | None, loader: Callable[[], Any]
    ) -> Any:
        """The batch with the rows its loader's ``DistributedSampler`` repeated masked out.

        Such a sampler evens out the processes' shards by repeating rows at the end of a
        shard (:func:`~torchshell.data.real_rows`); the rows of this process's shard seen so
        far (counted from ``batch_idx == 0``, the start of the loader's pass) say where they
        begin. Batches of any other loader pass unchanged. ``loader()`` gives the loader.
        """
        if batch_idx == 0 or idx not in self._shards:  # a new pass over this loader
            self._shards[idx] = [real_rows(shard_sampler(loader())), 0]
        shard = self._shards[idx]
        real, seen = shard
        n = rows(batch)
        shard[1] = seen + n
        if real is None or seen + n <= real:
            return batch
        keep = torch.arange(seen, seen + n) < real
        if "mask" in batch:
            keep &= torch.as_tensor(batch["mask"]).bool().reshape(-1)
        return {**batch, "mask": keep}


def eval_epoch_end(module: JaxModule, prefix: str) -> None:
    """Exact epoch means per loader, logged: ``val/loss``, or with several loaders Lightning's
    ``val/loss/dataloader_idx_N``."""
    where = f"in a {'validation' if prefix == 'val' else prefix} batch"
    for idx, means in module.evaluation.epoch_means(where).items():
        suffix = "" if idx is None else f"/dataloader_idx_{idx}"
        module.log_dict(
            {f"{prefix}/{k}{suffix}": v for k, v in means.items()},
            prog_bar=prefix == "val",
            add_dataloader_idx=False,  # (named here: epoch-end hooks have no loader)
        )
