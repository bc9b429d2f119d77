"""``nn.Embedding`` in a traced step, as torch has it: index checks and ``padding_idx``.

torch raises ``IndexError`` for an index past the table; JAX's gather fills it (NaN rows),
the loss turns NaN and the NaN guard blames the learning rate. While a step is traced, the
embedding op records which *batch fields* feed a table directly (the common case: token
ids); the shell then checks those fields on the host before each step, and an index out of
range is refused with the field, the table size and the value, as torch would refuse it.
Indices computed inside the model are not checked (they still end in NaN and the guard).

torch also never updates the ``padding_idx`` row from the positions holding it; a plain
gather would. The op here stops the gradient at those positions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch

from jaxcore import BatchError
from torchshell._errors import TorchModelError

__all__ = ["EmbeddingChecks"]


class EmbeddingChecks:
    """The batch fields that index embedding tables, found while tracing, checked per batch.

    Example:
        >>> checks = EmbeddingChecks()
        >>> checks.fields["[0]"] = 30
        >>> checks.check((torch.tensor([[1, 29]]),))
        >>> checks.check((torch.tensor([[1, 49]]),))
        Traceback (most recent call last):
        ...
        jaxcore._errors.BatchError: The batch field [0] indexes an embedding table of 30 rows, ...
    """

    def __init__(self) -> None:
        self.fields: dict[str, int] = {}  # batch path -> rows of the smallest table it indexes
        self._ids: dict[int, str] = {}

    def install(self, env: Any) -> None:
        """Routes ``aten.embedding`` of a torchax environment through :meth:`_embedding`."""
        self._env = env
        env.override_op_definition(torch.ops.aten.embedding.default, self._embedding)

    @contextlib.contextmanager
    def watching(self, batch: Any) -> Iterator[None]:
        """While tracing with ``batch`` (the torchax tensors the step sees)."""
        self._ids = {
            id(getattr(t, "_elem", t)): jax.tree_util.keystr(path)
            for path, t in jax.tree_util.tree_leaves_with_path(batch)
        }
        try:
            yield
        finally:
            self._ids = {}

    def _embedding(
        self,
        weight: Any,
        indices: Any,
        padding_idx: int = -1,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
    ) -> Any:
        if scale_grad_by_freq:
            raise TorchModelError(
                "nn.Embedding(scale_grad_by_freq=True) has no counterpart in the traced step "
                "(its gradient depends on the batch's index counts). Fix: set it to False."
            )
        w, idx = weight._elem, indices._elem
        path = self._ids.get(id(idx))
        if path is not None:
            rows = int(w.shape[0])
            self.fields[path] = min(rows, self.fields.get(path, rows))
        out = jnp.take(w, idx, axis=0)
        if padding_idx is not None and padding_idx >= 0:
            hit = (idx == padding_idx)[..., None]
            out = jnp.where(hit, jax.lax.stop_gradient(out), out)
        return self._env.j2t_iso(out)

    def check(self, batch: Any) -> None:
        """Refuses indices outside ``[0, rows)`` in the fields found while tracing
        (torch tensors, or concrete numpy or JAX arrays)."""
        if not self.fields:
            return
        for path, t in jax.tree_util.tree_leaves_with_path(batch):
            rows = self.fields.get(jax.tree_util.keystr(path))
            if rows is None or not hasattr(t, "shape") or not math.prod(t.shape):
                continue
            if isinstance(t, jax.core.Tracer):  # (inside a jit: checked on the host batch)
                continue
            low, high = int(t.min()), int(t.max())
            if low < 0 or high >= rows:
                bad = high if high >= rows else low
                raise BatchError(
                    f"The batch field {jax.tree_util.keystr(path)} indexes an embedding table "
                    f"of {rows} rows, but holds {bad} (torch raises IndexError: index out of "
                    f"range). Expected ids in [0, {rows - 1}]. Fix: map the ids into the "
                    "vocabulary in the Dataset (an unknown-token id), or build the embedding "
                    f"with num_embeddings > {high}."
                )
