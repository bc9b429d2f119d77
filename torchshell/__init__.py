"""torchshell: the PyTorch side users touch — Lightning module, data, tracking, export, CLI.

Names load lazily: DataLoader workers (spawned, see ``torchshell.data``) unpickle datasets
from this package and should not pay for importing JAX and Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JaxModule": "torchshell.module",
    "AsyncMLflowLogger": "torchshell.tracking",
    "SystemMetrics": "torchshell.tracking",
    "TrackingReport": "torchshell.tracking",
    "log_confusion_matrix": "torchshell.tracking",
    "log_torch_model": "torchshell.tracking",
    "run_tags": "torchshell.tracking",
    "params_to_state_dict": "torchshell.torch_model",
    "torch_model_fns": "torchshell.torch_model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'torchshell' has no attribute {name!r}")
