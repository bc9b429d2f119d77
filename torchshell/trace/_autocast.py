"""The user's own ``torch.autocast`` regions honoured in a traced step.

``with torch.autocast("cpu", dtype=torch.bfloat16): logits = self.model(x)`` inside
``training_step`` makes torch compute its matmuls and convolutions in bfloat16. torchax keeps
an autocast dtype of its own (``torchax.amp``), which torch's autocast state does not reach:
the region silently computed in float32. Here each traced op reads torch's autocast state and
runs under torchax's autocast with the same dtype, with torch's cast policy (``torch.nn.
functional.linear`` and the convolutions, which torchax runs as functions before any aten op,
get the policy of their aten ops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_DEVICES = ("cpu", "cuda")


def _as_aten(func: Any) -> Any:
    """The aten op whose autocast policy a torch function follows (itself otherwise)."""
    aten = torch.ops.aten
    return {
        torch.nn.functional.linear: aten.linear.default,
        torch.conv1d: aten.conv1d.default,
        torch.conv2d: aten.conv2d.default,
        torch.conv3d: aten.conv3d.default,
        torch.conv_transpose1d: aten.conv_transpose1d.default,
        torch.conv_transpose2d: aten.conv_transpose2d.input,
        torch.conv_transpose3d: aten.conv_transpose3d.input,
        torch.matmul: aten.matmul.default,
        torch.Tensor.matmul: aten.matmul.default,
        torch.Tensor.__matmul__: aten.matmul.default,
        torch.bmm: aten.bmm.default,
        torch.mm: aten.mm.default,
    }.get(func, func)


def user_autocast(env: Any, dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` (one torch op on torchax tensors) under torch's current autocast region.

    Example:
        >>> import torchax
        >>> env = torchax.default_env()
        >>> seen = []
        >>> run = user_autocast(env, lambda f, t, a, k=None: seen.append(f) or 1)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     _ = run(torch.nn.functional.linear, (), (), {})
        >>> seen == [torch.nn.functional.linear]
        True
    """
    from torchax import amp

    def autocast_dispatch(func: Any, types: Any, args: Any, kwargs: Any = None) -> Any:
        if env.param.autocast_dtype is None:
            for device in _DEVICES:
                if torch.is_autocast_enabled(device):
                    dtype = torch.get_autocast_dtype(device)
                    policy = amp.autocast_policy.get(_as_aten(func))
                    if policy is not None and func not in amp.autocast_policy:
                        args, kwargs = amp.execute_policy(policy, args, kwargs or {}, dtype)
                    with env.override_property(autocast_dtype=dtype):
                        return dispatch(func, types, args, kwargs)
        return dispatch(func, types, args, kwargs)

    return autocast_dispatch
