"""torchshell: the PyTorch side users touch — Lightning module, data, tracking, export.

Names load lazily: DataLoader workers (spawned, see ``torchshell.data``) unpickle datasets
from this package and should not pay for importing JAX and Lightning. The ``coreshell``
command lives apart, in :mod:`torchshell.app` (the library never imports it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time __getattr__ loads them
    from torchshell._errors import (
        CheckpointError,
        ConfigError,
        DistributedError,
        ShellError,
        TorchModelError,
        TrackingError,
    )
    from torchshell.module import JaxModule
    from torchshell.torch_model import params_to_state_dict, torch_model_fns
    from torchshell.tracking import (
        AsyncMLflowLogger,
        SystemMetrics,
        TrackingReport,
        log_confusion_matrix,
        log_torch_model,
        replay,
        run_tags,
    )

_EXPORTS = {
    "JaxModule": "torchshell.module",
    "AsyncMLflowLogger": "torchshell.tracking",
    "SystemMetrics": "torchshell.tracking",
    "TrackingReport": "torchshell.tracking",
    "log_confusion_matrix": "torchshell.tracking",
    "log_torch_model": "torchshell.tracking",
    "replay": "torchshell.tracking",
    "run_tags": "torchshell.tracking",
    "params_to_state_dict": "torchshell.torch_model",
    "torch_model_fns": "torchshell.torch_model",
    "CheckpointError": "torchshell._errors",
    "ConfigError": "torchshell._errors",
    "DistributedError": "torchshell._errors",
    "ShellError": "torchshell._errors",
    "TorchModelError": "torchshell._errors",
    "TrackingError": "torchshell._errors",
}

__all__ = [
    "AsyncMLflowLogger",
    "CheckpointError",
    "ConfigError",
    "DistributedError",
    "JaxModule",
    "ShellError",
    "SystemMetrics",
    "TorchModelError",
    "TrackingError",
    "TrackingReport",
    "log_confusion_matrix",
    "log_torch_model",
    "params_to_state_dict",
    "replay",
    "run_tags",
    "torch_model_fns",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'torchshell' has no attribute {name!r}")
