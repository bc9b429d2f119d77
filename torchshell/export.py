"""Trained JAX params -> the torch twin, as safetensors, with a parity check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

import bridge

PyTree = Any


def export_twin(params: PyTree, twin: torch.nn.Module, path: str | Path) -> Path:
    """Writes ``params`` as the twin's ``state_dict`` to a safetensors file and loads it.

    The conversion is strict (every twin key filled once, shapes and dtypes equal) and the
    twin ends up holding the trained weights, in eval mode.

    Args:
        params: the trained Flax params.
        twin: the torch twin module.
        path: the ``.safetensors`` file to write.

    Returns:
        The written path.

    Example:
        >>> import jax, jax.numpy as jnp, tempfile, os
        >>> from jaxcore.models.digits import MLP
        >>> from torchshell.twins.digits import MLP as Twin
        >>> p = MLP(features=(8,)).init(jax.random.key(0), jnp.ones((1, 64)))["params"]
        >>> out = export_twin(p, Twin(features=(8,)), os.path.join(tempfile.mkdtemp(), "m.st"))
        >>> out.exists()
        True
    """
    state_dict = bridge.export_state_dict(params, twin)
    twin.load_state_dict(state_dict, strict=True)
    twin.eval()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(
        {k: v.contiguous() for k, v in state_dict.items()},
        str(tmp),
        metadata={"format": "pt", "producer": "coreshell"},
    )
    tmp.replace(path)  # atomic: never a half-written export
    return path


def max_abs_diff(jax_outputs: Any, torch_outputs: torch.Tensor) -> float:
    """Largest absolute difference between JAX and torch outputs of the same inputs."""
    return float(np.max(np.abs(np.asarray(jax_outputs) - torch_outputs.detach().numpy())))
