"""A module holding a submodule (or a tensor) under several names, kept intact by a trace.

``torch.func.functional_call(..., tie_weights=True)`` swaps each name of a tied pair in turn
and reads the second name's "original" after the first swap, so it puts a torchax tensor
back where the module's own ``Parameter`` was (pytorch#164759: locuslab's TCN, where
``self.conv1`` is ``self.net[0]``; one ``nn.Linear`` under two attribute names). The
module's own ``forward`` then raises outside torchax, and ``load_state_dict`` fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["shared_weights_kept"]


def shared_weights_kept(module: torch.nn.Module) -> Callable[[], None] | None:
    """For a module with a submodule, parameter or buffer reachable under several names: a
    function that puts the module's own tensors back wherever a trace left a torchax one
    (nothing else is touched); ``None`` for a module where each is reachable once.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> net = torch.nn.Sequential(lin, lin)
        >>> restore = shared_weights_kept(net)
        >>> net[0]._parameters["weight"] = torch.zeros(2, 2)  # (a plain tensor: kept)
        >>> restore(); type(net[0].weight).__name__
        'Tensor'
        >>> shared_weights_kept(torch.nn.Linear(2, 2)) is None
        True
    """
    modules = list(module.named_modules(remove_duplicate=False))
    tensors: list[tuple[str, torch.Tensor]] = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    if len(modules) == len({id(m) for _, m in modules}) and len(tensors) == len(
        {id(t) for _, t in tensors}
    ):
        return None
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = [
        (slots, key, value)
        for m in module.modules()
        for slots in (m._parameters, m._buffers)
        for key, value in slots.items()
        if value is not None
    ]

    def restore() -> None:
        for slots, key, value in saved:
            now = slots.get(key)
            if now is not value and type(now).__module__.startswith("torchax"):
                slots[key] = value

    return restore
