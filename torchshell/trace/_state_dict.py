"""The trained params and model state of a traced torch module as its ``state_dict``."""

from __future__ import annotations

import collections
import copy
import itertools
from typing import Any

import torch
from torch import nn

import bridge
from torchshell._errors import TorchModelError

PyTree = Any


def params_to_state_dict(
    params: PyTree, model_state: PyTree, module: nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The trained params and model state as the module's ``state_dict`` (the identity).

    With ``module``, tied parameters are filled under every name the module's ``state_dict``
    uses, dtypes are the module's own (``num_batches_tracked`` back to int64), and keys and
    shapes are checked, so ``module.load_state_dict(sd, strict=True)`` cannot fail.

    Args:
        params: ``{state_dict name: array}`` from :func:`torch_model_fns`' params.
        model_state: the model state (buffers, frozen parameters).
        module: the torch module the state dict is for.

    Returns:
        ``{name: torch.Tensor}`` on CPU, owning its memory (never aliasing JAX buffers).

    Raises:
        TorchModelError: keys or shapes that do not match ``module``.

    Example:
        >>> import jax, jax.numpy as jnp, torch
        >>> from torchshell.twins.digits import MLP
        >>> net = MLP(64, features=(8,))
        >>> from torchshell.torch_model import torch_model_fns
        >>> fns = torch_model_fns(net)
        >>> params, state = fns.init(jax.random.key(0), {"x": jnp.ones((2, 64))})
        >>> net.load_state_dict(params_to_state_dict(params, state, net), strict=True)
        <All keys matched successfully>
    """
    merged = {**dict(model_state), **dict(params)}
    tensors = {k: bridge.to_torch(v).clone() for k, v in merged.items()}
    if module is None:
        return tensors
    canonical: dict[int, str] = {}
    for name, t in itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers()
    ):
        canonical.setdefault(id(t), name)
    reference = module.state_dict(keep_vars=True)
    # torch's own state_dict type, with the modules' versions (``_metadata``) that their
    # ``_load_from_state_dict`` reads (torchvision's MNASNet refuses a dict without them)
    out: dict[str, torch.Tensor] = collections.OrderedDict()
    out._metadata = copy.deepcopy(getattr(reference, "_metadata", None))  # type: ignore[attr-defined]
    missing, wrong = [], []
    for key, ref in reference.items():
        src = canonical.get(id(ref), key)
        if src not in tensors:
            missing.append(key)
            continue
        t = tensors[src]
        if tuple(t.shape) != tuple(ref.shape):
            wrong.append(f"{key}: {tuple(t.shape)} vs module {tuple(ref.shape)}")
            continue
        out[key] = t.to(ref.dtype)
    used = {canonical.get(id(r), k) for k, r in reference.items()}
    unexpected = sorted(set(tensors) - used)
    if missing or wrong or unexpected:
        raise TorchModelError(
            f"The params and model state do not match {type(module).__name__}'s state_dict: "
            f"missing {missing}, unexpected {unexpected}, shape mismatches {wrong}. Fix: export "
            "with the same module class and constructor arguments that were extracted."
        )
    return out
