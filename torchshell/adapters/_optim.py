"""The Flax and torch adapters' ``optim`` group: the Trainer's clipping, then ``module.tx``."""

from __future__ import annotations

from typing import Any

import optax

from torchshell._errors import ConfigError
from torchshell.adapters._clip import torch_clip

__all__ = ["OptaxOptimizer", "optax_options"]


def optax_options(optimizer: Any, accum_steps: int) -> optax.GradientTransformation | None:
    """``JaxModule``'s ``optimizer`` (an optax transform, or None for the adapter's own) and
    ``accum_steps`` (micro-batches per optimizer step), checked.

    Raises:
        ConfigError: a torch optimizer (``from_torch``/``from_lightning`` map those), or
            ``accum_steps < 1``.
    """
    import torch

    if accum_steps < 1:
        raise ConfigError(
            f"accum_steps must be >= 1, got {accum_steps}. Fix: use 1 to turn it off."
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer={type(optimizer).__name__}(...): a torch optimizer is mapped onto "
            "the torch module's own parameters. Fix: JaxModule.from_torch(module, loss, "
            "optimizer) or from_lightning, or an optax transform here "
            "(jaxcore.make_optimizer('adamw', lr=...))."
        )
    return optimizer  # type: ignore[no-any-return]


class OptaxOptimizer:
    """The adapter's optimizer group (``adapter.optim``): the Flax and torch adapters' one.

    The protocol the module's hooks call, each method given the
    :class:`~torchshell.module.JaxModule`; ``LightningAdapter``'s maps the user's
    ``configure_optimizers`` instead (:mod:`torchshell.port._optim_part`).

    Example:
        >>> OptaxOptimizer().configure_optimizers(None)
        []
    """

    def configure_optimizers(self, module: Any) -> Any:
        """``JaxModule.configure_optimizers``: no torch optimizer, the optax one runs inside
        the JAX step."""
        return []  # (an empty list, unlike None, is a valid "no optimizer" for Lightning)

    def optimizer(self, module: Any) -> optax.GradientTransformation:
        """The optax transform the step applies: the Trainer's clipping, then ``module.tx``
        (called when the state and the train step are built)."""
        if module.tx is None:
            raise ConfigError(
                "JaxModule needs an optax optimizer. Fix: pass optimizer=... (e.g. "
                "jaxcore.make_optimizer(lr=1e-3))."
            )
        flags = module.flags
        if flags.clip_val is None:
            return module.tx  # type: ignore[no-any-return]
        return optax.chain(torch_clip(flags.clip_val, flags.clip_algorithm), module.tx)

    def on_fit_start(self, module: Any) -> None:
        """At every ``fit``, after a new fit of a trained module restarted the optimizer
        state (nothing more here)."""

    def on_train_start(self, module: Any) -> None:
        """Once per ``fit``, before the first batch, the run's loaders known (nothing here)."""
