"""Error classes of the bridge: each names the field, what was found, and the fix."""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every error the bridge raises on bad input."""


class TransferError(BridgeError, ValueError):
    """A tensor that cannot cross to JAX as asked (layout, dtype, strict mode)."""


class StateDictError(BridgeError, KeyError):
    """A param tree and a state_dict that do not match key for key and shape for shape."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class PrefetchError(BridgeError, ValueError):
    """Bad arguments to :func:`bridge.prefetch` (e.g. a queue size below 1)."""


class SafetensorsError(BridgeError, ValueError):
    """A safetensors file that is missing, unreadable, or not what it should hold."""


class ParityError(BridgeError, ValueError):
    """JAX and torch outputs that differ beyond tolerance, or cannot be compared."""
