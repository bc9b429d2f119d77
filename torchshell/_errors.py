"""Error classes of torchshell: each names what was expected, what came in, and the fix."""

from __future__ import annotations

import jaxcore._errors as _jaxcore_errors


class ShellError(Exception):
    """Base class of every error torchshell raises on bad input."""


class CheckpointError(ShellError, RuntimeError):
    """A checkpoint that is damaged or does not belong to this model."""


class ConfigError(ShellError, _jaxcore_errors.ConfigError):
    """A configuration value the shell cannot use.

    One class to catch: it subclasses ``jaxcore.ConfigError`` (the core cannot import the
    shell), so ``except jaxcore.ConfigError`` catches both; both are ``ValueError``s.
    """


class TorchModelError(ShellError, ValueError):
    """A torch ``nn.Module`` that cannot become a JAX model (an op torchax cannot lower)."""


class TrackingError(ShellError, ValueError):
    """A tracking request the MLflow logger cannot carry out as asked."""


class DistributedError(ShellError, RuntimeError):
    """The multi-process runtime could not start, or a process of the run stopped."""
