"""bridge: torch <-> JAX hand-over (DLPack) and param tree <-> state_dict conversion."""

from bridge._batch import pad_batch, round_up, rows, to_jax
from bridge._convert import as_jax, as_numpy, as_torch, narrow
from bridge._dlpack import to_torch
from bridge._errors import (
    BridgeError,
    ParityError,
    PrefetchError,
    SafetensorsError,
    StateDictError,
    TransferError,
)
from bridge._layouts import (
    BUILTIN_RULES,
    CONV_KERNEL,
    CONV_TRANSPOSE_KERNEL,
    DENSE_KERNEL,
    Transform,
)
from bridge._origin import Origin, handed_over
from bridge._parity import ParityReport, check_parity
from bridge._prefetch import Prefetcher, prefetch
from bridge._safetensors import load_safetensors, save_safetensors
from bridge._state_dict import export_state_dict, import_state_dict, state_dict_sources
from bridge._stats import TransferStats, new_stats
from bridge._transfer import BatchTransfer
from bridge._tree import path_str

__all__ = [
    "BUILTIN_RULES",
    "CONV_KERNEL",
    "CONV_TRANSPOSE_KERNEL",
    "DENSE_KERNEL",
    "BatchTransfer",
    "BridgeError",
    "Origin",
    "ParityError",
    "ParityReport",
    "PrefetchError",
    "Prefetcher",
    "SafetensorsError",
    "StateDictError",
    "TransferError",
    "TransferStats",
    "Transform",
    "as_jax",
    "as_numpy",
    "as_torch",
    "check_parity",
    "export_state_dict",
    "handed_over",
    "import_state_dict",
    "load_safetensors",
    "narrow",
    "new_stats",
    "pad_batch",
    "path_str",
    "prefetch",
    "round_up",
    "rows",
    "save_safetensors",
    "state_dict_sources",
    "to_jax",
    "to_torch",
]
