"""The model interface jaxcore trains: two pure functions, whatever wrote them.

A Flax module, or a torch ``nn.Module`` traced by torchax in the shell, both reach the core
as a :class:`ModelFns`: ``init(rng, batch) -> (params, model_state)`` and
``apply(params, model_state, batch, rng, train) -> (outputs, model_state)``.
"""

from __future__ import annotations

import inspect
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


def mode_kwargs(call: Callable[..., Any]) -> Callable[[bool], dict[str, Any]]:
    """How a model's ``__call__`` is told train or eval mode, from its signature.

    ``train=``, ``training=``, ``is_training=`` take the mode, ``deterministic=`` its
    negation (Flax's own layers' name); a call with none of them gets nothing.

    Example:
        >>> mode_kwargs(lambda x, deterministic=True: x)(True)
        {'deterministic': False}
        >>> mode_kwargs(lambda x: x)(True)
        {}
    """
    try:
        names = set(inspect.signature(call).parameters)
    except (TypeError, ValueError):  # no signature to read: the documented convention
        names = {"train"}
    for name in ("train", "training", "is_training"):
        if name in names:
            return lambda train, name=name: {name: train}  # type: ignore[misc]
    if "deterministic" in names:
        return lambda train: {"deterministic": not train}
    return lambda train: {}


def linen_model(module: nn.Module, inputs: Sequence[str] = ("x",)) -> ModelFns:
    """Wraps a Flax linen module whose ``__call__`` takes ``*inputs`` (and a mode flag).

    The mode reaches ``__call__`` as its signature asks (:func:`mode_kwargs`: ``train=``,
    ``training=``, ``deterministic=``; nothing when it takes none). Collections other than
    ``params`` (e.g. ``batch_stats``) become the model state and are updated in training;
    dropout draws from the ``"dropout"`` rng stream.

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
    mode = mode_kwargs(module.__call__)

    def init(rng: jax.Array, batch: Batch) -> tuple[PyTree, PyTree]:
        p_key, d_key = jax.random.split(rng)
        variables = module.init(
            {"params": p_key, "dropout": d_key}, *_inputs(batch, keys), **mode(False)
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
            variables, *_inputs(batch, keys), **mode(train), rngs={"dropout": rng}, mutable=mutable
        )
        if train and model_state:
            outputs, new_state = out
            return outputs, dict(new_state)
        return (out[0] if train else out), model_state

    return ModelFns(init, apply)


def nnx_model(module: Any, inputs: Sequence[str] = ("x",)) -> ModelFns:
    """Wraps a Flax NNX module (``nnx.Module``) as pure functions.

    The params are its ``nnx.Param`` variables as a plain nested dict (``{"l1": {"kernel":
    ...}}``, the module's own initial values); its other variables (``BatchStat``...) are the
    model state, updated in training. Each call rebuilds the module with ``nnx.merge``, sets
    train or eval mode (``.train()`` / ``.eval()``, plus the mode argument its ``__call__``
    takes, see :func:`mode_kwargs`) and reseeds its rng streams from the step's key, so
    dropout differs every step and is fixed by the seed. The module itself is not changed.

    Args:
        module: an ``nnx.Module``.
        inputs: batch keys passed positionally to ``module.__call__``.

    Returns:
        The module's :class:`ModelFns`.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> fns = nnx_model(nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
        >>> params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 4))})
        >>> sorted(params), state
        (['bias', 'kernel'], {})
        >>> fns.apply(params, state, {"x": jnp.ones((2, 4))}, jax.random.key(1), True)[0].shape
        (2, 3)
    """
    from flax import nnx

    keys = tuple(inputs)
    mode = mode_kwargs(module.__call__)
    graphdef, params, rngs, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
    tags = sorted(
        {node.tag for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)}
    )
    params0, rest0 = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    def init(rng: jax.Array, batch: Batch) -> tuple[PyTree, PyTree]:
        return jax.tree.map(jax.numpy.asarray, (params0, rest0))

    def apply(
        params_: PyTree, model_state: PyTree, batch: Batch, rng: jax.Array, train: bool
    ) -> tuple[PyTree, PyTree]:
        # templates copied at this trace level (nnx refuses to mutate an outer trace's)
        p_state, g_state, r_state = jax.tree.map(lambda x: x, (params, rngs, rest))
        nnx.replace_by_pure_dict(p_state, params_)
        nnx.replace_by_pure_dict(r_state, model_state)
        model = nnx.merge(graphdef, p_state, g_state, r_state)
        model.train() if train else model.eval()
        if tags:
            keys_ = jax.random.split(rng, len(tags))
            streams: dict[str, Any] = {t: keys_[i] for i, t in enumerate(tags)}
            nnx.reseed(model, **streams)
        outputs = model(*_inputs(batch, keys), **mode(train))
        new_rest = nnx.state(model, nnx.Not(nnx.Any(nnx.Param, nnx.RngState)))
        return outputs, (nnx.to_pure_dict(new_rest) if train else model_state)

    return ModelFns(init, apply)
