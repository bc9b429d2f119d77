"""bridge: torch <-> JAX hand-over (DLPack) and param tree <-> state_dict conversion."""

from bridge._batch import pad_batch, to_jax
from bridge._dlpack import new_stats, to_torch
from bridge._errors import BridgeError, StateDictError, TransferError
from bridge._state_dict import BUILTIN_RULES, export_state_dict, import_state_dict

__all__ = [
    "BUILTIN_RULES",
    "BridgeError",
    "StateDictError",
    "TransferError",
    "export_state_dict",
    "import_state_dict",
    "new_stats",
    "pad_batch",
    "to_jax",
    "to_torch",
]
