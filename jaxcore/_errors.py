"""Error classes of jaxcore: each names what was expected, what came in, and the fix."""

from __future__ import annotations


class JaxCoreError(Exception):
    """Base class of every error jaxcore raises on bad input."""


class MeshError(JaxCoreError, ValueError):
    """Mesh axes that do not fit the available devices."""


class ShardingError(JaxCoreError, ValueError):
    """A partition rule that does not fit a parameter."""


class BatchError(JaxCoreError, ValueError):
    """A batch whose keys, shapes or dtypes do not match what the step expects."""


class ConfigError(JaxCoreError, ValueError):
    """An optimizer or step option that jaxcore does not know."""


class NonFiniteError(JaxCoreError, FloatingPointError):
    """A training step whose loss or gradients were NaN or Inf, under ``nan_policy="stop"``."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
