"""``nn.Embedding`` in a traced step, as torch has it: index checks and ``padding_idx``.

torch raises ``IndexError`` for an index past the table; JAX's gather fills it (NaN rows),
the loss turns NaN and the NaN guard would blame the learning rate. The embedding op here
checks every index array it gets inside the compiled step (one min and one max reduction,
:func:`jaxcore.guard.index_check`): the batch fields that feed a table directly (token ids)
and indices computed inside the model alike. A step holding one out of range is refused
(``nan_policy`` ``"skip"``/``"stop"``: no NaN reaches the weights) and, under ``"stop"``,
the shell raises at the logging cadence (:func:`jaxcore.check_finite`) a ``BatchError``
naming the field (or the table, for a computed index), the table's size, a bad value and
the fix. No host pass over the batch.

torch also never updates the ``padding_idx`` row from the positions holding it; a plain
gather would. The op here stops the gradient at those positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch

from jaxcore.guard import index_check
from torchshell._errors import TorchModelError
from torchshell.trace._targets import batch_field, fields_named

__all__ = ["EVAL_CHECK_KEY", "EmbeddingChecks", "embedding_message"]

# an evaluation hook's ``[code, value]`` input check among its logs (``LightningPort.call``):
# ``jaxcore.guard.raise_failed(logs.pop(EVAL_CHECK_KEY), "in a validation_step batch")``
EVAL_CHECK_KEY = "~torchshell.input_check"


def embedding_message(rows: int, field: str | None, table: str | None = None) -> str:
    """The error of an index outside an embedding table of ``rows`` rows, with ``{value}``
    and ``{where}`` (the step, or the evaluation batch) for :func:`jaxcore.guard.input_check`
    to fill.

    Args:
        rows: the table's rows.
        field: the batch field the indices came from straight (its ``jax`` keystr), or
            ``None`` for indices computed inside the model.
        table: the table's module path, when known.

    Example:
        >>> embedding_message(30, "['ids']").split(" {where}")[0]
        "The batch field ['ids'] indexes an embedding table of 30 rows, but holds {value}"
    """
    name = f" ({table})" if table else ""
    if field is not None:
        what = f"The batch field {_plain(field)} indexes an embedding table of {rows} rows{name}"
        fix = "map the ids into the vocabulary in the Dataset (an unknown-token id)"
    else:
        what = f"An index computed inside the model indexes an embedding table of {rows} rows{name}"
        fix = "check how the model computes those indices"
    return (
        f"{what}, but holds {{value}} {{where}}. torch raises IndexError: index out of range "
        f"on it; expected indices in [0, {rows - 1}]. Fix: {fix}, or build the embedding "
        "with num_embeddings > {value}."
    )


def _plain(text: str) -> str:
    return text.replace("{", "(").replace("}", ")")


class EmbeddingChecks:
    """``aten.embedding`` of a torchax environment, with its indices checked in the step.

    Example:
        >>> import jax.numpy as jnp, jaxcore, torch, torchax
        >>> from jaxcore.guard import checking
        >>> checks = EmbeddingChecks()
        >>> checks.install(torchax.default_env())
        >>> def step(w, ids):
        ...     with checking({"ids": ids}) as found, checks.watching({"ids": ids}):
        ...         checks._embedding(checks._env.j2t_iso(w), checks._env.j2t_iso(ids))
        ...         return found.result()
        >>> jax.jit(step)(jnp.ones((30, 4)), jnp.array([[1, 49]])).tolist()[1]
        49
    """

    def __init__(self) -> None:
        self._tables: dict[tuple[int, ...], str | None] = {}
        self._module: torch.nn.Module | None = None

    def install(self, env: Any, module: torch.nn.Module | None = None) -> None:
        """Routes ``aten.embedding`` of a torchax environment through :meth:`_embedding`;
        ``module`` (the traced one) names a table by its path when its shape is unique."""
        self._env, self._module = env, module
        env.override_op_definition(torch.ops.aten.embedding.default, self._embedding)
        env.override_op_definition(torch.ops.aten.embedding_renorm_.default, _renorm_refused)

    @contextlib.contextmanager
    def watching(self, batch: Any) -> Iterator[None]:
        """While tracing with ``batch`` (the torchax tensors or JAX values the step sees):
        indices (and class-index targets) that are one of its fields are named by that
        field."""
        with fields_named(batch):  # (class-index targets are named the same way: _targets)
            yield

    def _table(self, shape: tuple[int, ...]) -> str | None:
        """The path of the module's only ``nn.Embedding`` of this shape, else ``None``."""
        if shape not in self._tables:
            named = [
                f"{name or 'the model'}: nn.Embedding{list(shape)}"
                for name, m in (self._module.named_modules() if self._module is not None else ())
                if isinstance(m, torch.nn.Embedding) and tuple(m.weight.shape) == shape
            ]
            self._tables[shape] = named[0] if len(named) == 1 else None
        return self._tables[shape]

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
        rows = int(w.shape[0])
        field = batch_field(idx)
        index_check(idx, rows, embedding_message(rows, field, self._table(tuple(w.shape))))
        out = jnp.take(w, idx, axis=0)
        if padding_idx is not None and padding_idx >= 0:
            hit = (idx == padding_idx)[..., None]
            out = jnp.where(hit, jax.lax.stop_gradient(out), out)
        return self._env.j2t_iso(out)


def _renorm_refused(weight: Any, indices: Any, max_norm: float, norm_type: float) -> Any:
    """``nn.Embedding(max_norm=...)``: refused, naming it (torchax's lowering read the
    indices' values and its error spoke of "a constant tensor passed where a number is
    read")."""
    from torchshell.trace._dtypes import _module_site

    raise TorchModelError(
        f"nn.Embedding(max_norm={max_norm:g}) (or F.embedding(..., max_norm=)) in "
        f"{_module_site()} renormalises the rows it looks up, in place in its weight, in "
        "every forward (torch's embedding_renorm_): the compiled step cannot write a trained "
        "weight back in place, so it would train other weights than torch. Fix: drop "
        "max_norm, or renormalise the table in a host hook (what it changes goes back into "
        "the step's weights): def on_train_batch_start(self, batch, batch_idx): with "
        f"torch.no_grad(): self.<embedding>.weight.renorm_({norm_type:g}, 0, {max_norm:g}) "
        "(every row, not only the looked-up ones)."
    )
