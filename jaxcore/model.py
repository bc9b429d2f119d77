"""The model interface jaxcore trains: two pure functions, whatever wrote them.

A Flax module, or a torch ``nn.Module`` traced by torchax in the shell, both reach the core
as a :class:`ModelFns`: ``init(rng, batch) -> (params, model_state)`` and
``apply(params, model_state, batch, rng, train) -> (outputs, model_state)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from jaxcore._errors import BatchError

PyTree = Any
Batch = Mapping[str, jax.Array]


class ModelFns(NamedTuple):
    """Pure init and apply functions of a model.

    Attributes:
        init: ``(rng, batch) -> (params, model_state)``.
        apply: ``(params, model_state, batch, rng, train) -> (outputs, model_state)``.
    """

    init: Callable[[jax.Array, Batch], tuple[PyTree, PyTree]]
    apply: Callable[[PyTree, PyTree, Batch, jax.Array, bool], tuple[PyTree, PyTree]]


def _inputs(batch: Batch, keys: Sequence[str]) -> list[jax.Array]:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise BatchError(
            f"The model reads batch keys {list(keys)}, but the batch has {sorted(batch)}: "
            f"missing {missing}. Fix: name the fields in the Dataset/collate as the model "
            "expects, or set the model's `inputs` to the batch's key names."
        )
    return [batch[k] for k in keys]


def linen_model(module: nn.Module, inputs: Sequence[str] = ("x",)) -> ModelFns:
    """Wraps a Flax linen module whose ``__call__`` takes ``*inputs, train=bool``.

    Collections other than ``params`` (e.g. ``batch_stats``) become the model state and are
    updated in training; dropout draws from the ``"dropout"`` rng stream.

    Args:
        module: a linen module.
        inputs: batch keys passed positionally to ``module.__call__``.

    Returns:
        The module's :class:`ModelFns`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxcore.models.digits import MLP
        >>> fns = linen_model(MLP(features=(8,), num_classes=3))
        >>> params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 4))})
        >>> fns.apply(params, state, {"x": jnp.ones((2, 4))}, jax.random.key(1), False)[0].shape
        (2, 3)
    """
    keys = tuple(inputs)

    def init(rng: jax.Array, batch: Batch) -> tuple[PyTree, PyTree]:
        p_key, d_key = jax.random.split(rng)
        variables = module.init(
            {"params": p_key, "dropout": d_key}, *_inputs(batch, keys), train=False
        )
        variables = dict(variables)
        params = variables.pop("params")
        return params, variables

    def apply(
        params: PyTree, model_state: PyTree, batch: Batch, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]:
        variables = {"params": params, **model_state}
        mutable = list(model_state) if train else False
        out = module.apply(
            variables, *_inputs(batch, keys), train=train, rngs={"dropout": rng}, mutable=mutable
        )
        if train and model_state:
            outputs, new_state = out
            return outputs, dict(new_state)
        return (out[0] if train else out), model_state

    return ModelFns(init, apply)
