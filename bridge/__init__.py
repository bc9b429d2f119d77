"""bridge: torch <-> JAX hand-over (DLPack) and param tree <-> state_dict conversion."""

from bridge._batch import pad_batch, to_jax
from bridge._dlpack import to_torch
from bridge._errors import BridgeError, StateDictError, TransferError
from bridge._prefetch import Prefetcher, prefetch
from bridge._state_dict import BUILTIN_RULES, export_state_dict, import_state_dict
from bridge._stats import TransferStats, new_stats

__all__ = [
    "BUILTIN_RULES",
    "BridgeError",
    "Prefetcher",
    "StateDictError",
    "TransferError",
    "TransferStats",
    "export_state_dict",
    "import_state_dict",
    "new_stats",
    "pad_batch",
    "prefetch",
    "to_jax",
    "to_torch",
]
