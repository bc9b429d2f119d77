"""Lightning's ``gradient_clip_val`` / ``gradient_clip_algorithm`` as an optax transformation."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import optax

from torchshell._errors import ConfigError


def torch_clip(
    value: float | None,
    algorithm: str | None = None,
    *,
    only: Collection[str] | None = None,
) -> optax.GradientTransformation:
    """Gradient clipping exactly as Lightning does it with torch.

    ``"norm"`` (the default) is ``torch.nn.utils.clip_grad_norm_``: the 2-norm over all
    gradients together, every gradient scaled by ``min(value / (norm + 1e-6), 1)``. ``"value"``
    is ``clip_grad_value_``: each element clamped to ``[-value, value]``.

    Args:
        value: Lightning's ``gradient_clip_val``; ``None`` or ``0`` means no clipping.
        algorithm: Lightning's ``gradient_clip_algorithm``: ``"norm"`` (``None``) or ``"value"``.
        only: for flat ``{name: grad}`` trees, the names to clip (Lightning clips the
            optimizer's parameters only, e.g. ``MappedOptimizer.param_names``); others pass
            through unchanged and stay out of the norm.

    Returns:
        An optax transformation (stateless).

    Raises:
        ConfigError: a negative value or an unknown algorithm.

    >>> import jax.numpy as jnp
    >>> tx = torch_clip(1.0, "norm")
    >>> g, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
    >>> [round(x, 5) for x in g["w"].tolist()]
    [0.6, 0.8]
    >>> tx = torch_clip(0.5, "value")
    >>> tx.update({"w": jnp.array([3.0, -0.25])}, tx.init(None))[0]["w"].tolist()
    [0.5, -0.25]
    """
    if value is None or value == 0:
        return optax.identity()
    value = float(value)
    if value < 0:
        raise ConfigError(
            f"gradient_clip_val must be >= 0 (0 or None: no clipping), got {value}; "
            "set Trainer(gradient_clip_val=...) to a positive number"
        )
    algo = "norm" if algorithm is None else str(getattr(algorithm, "value", algorithm)).lower()
    if algo not in ("norm", "value"):
        raise ConfigError(
            f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}; "
            "set Trainer(gradient_clip_algorithm='norm') or 'value'"
        )

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        picked = updates if only is None else {k: v for k, v in updates.items() if k in only}
        if algo == "value":
            clipped = jax.tree.map(lambda g: jnp.clip(g, -value, value), picked)
        else:
            leaves = jax.tree.leaves(picked)
            if not leaves:
                return updates, state
            norms = jnp.stack([jnp.linalg.norm(g.ravel().astype(jnp.float32)) for g in leaves])
            total = jnp.linalg.norm(norms)
            coef = jnp.minimum(value / (total + 1e-6), 1.0)
            clipped = jax.tree.map(lambda g: (g * coef).astype(g.dtype), picked)
        if only is None:
            return clipped, state
        return {k: clipped.get(k, v) for k, v in updates.items()}, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
