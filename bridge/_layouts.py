"""Layouts of weights, Flax -> torch: :class:`Transform`, the kernels, the built-in rules.

Layouts (Flax -> torch):

- Dense ``kernel (in, out)`` -> Linear ``weight (out, in)``.
- Conv ``kernel (*spatial, in/groups, out)`` -> ConvNd ``weight (out, in/groups, *spatial)``
  (groups and depthwise included: the permutation is the same).
- ConvTranspose (Flax default ``transpose_kernel=False``) ``kernel (*spatial, in, out)`` ->
  ConvTransposeNd ``weight (in, out, *spatial)`` *spatially flipped*: Flax then runs a plain
  dilated convolution with the kernel as stored, torch the gradient of a convolution. A Flax
  ConvTranspose with ``transpose_kernel=True`` stores ``(*spatial, out, in)`` and needs no flip:
  pass a rule with :data:`CONV_KERNEL` for it. Padding is not a weight: match it yourself
  (Flax ``'VALID'`` equals torch ``padding=0`` when ``kernel_size >= stride``).
- LayerNorm / RMSNorm / GroupNorm / BatchNorm ``scale``, ``bias`` -> ``weight``, ``bias``;
  BatchNorm ``batch_stats`` ``mean``, ``var`` -> ``running_mean``, ``running_var`` and a
  ``num_batches_tracked`` counter (Flax keeps none: exported as 0, ignored on import).
- Embed ``embedding`` -> Embedding ``weight`` (same layout).
- Names: ``a/b/kernel`` -> ``a.b.weight``; ``layers_0`` -> ``layers.0``; nnx list indices
  ``layers/0`` -> ``layers.0``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bridge._errors import StateDictError

TensorFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """A layout change of one array, Flax -> torch and back (torch tensors both ways).

    Example:
        >>> import torch
        >>> t = Transform(lambda x: x.T, lambda x: x.T, "dense")
        >>> tuple(t.to_torch(torch.zeros(3, 2)).shape)
        (2, 3)
    """

    to_torch: TensorFn
    to_flax: TensorFn
    name: str = "custom"


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 0)


def _conv_to_torch(x: torch.Tensor) -> torch.Tensor:  # (*sp, in, out) -> (out, in, *sp)
    n = x.ndim
    return x.permute(n - 1, n - 2, *range(n - 2))


def _conv_to_flax(x: torch.Tensor) -> torch.Tensor:  # (out, in, *sp) -> (*sp, in, out)
    n = x.ndim
    return x.permute(*range(2, n), 1, 0)


def _convt_to_torch(x: torch.Tensor) -> torch.Tensor:  # (*sp, in, out) -> (in, out, *sp)
    n = x.ndim
    return x.flip(list(range(n - 2))).permute(n - 2, n - 1, *range(n - 2))


def _convt_to_flax(x: torch.Tensor) -> torch.Tensor:  # (in, out, *sp) -> (*sp, in, out)
    n = x.ndim
    return x.flip(list(range(2, n))).permute(*range(2, n), 0, 1)


IDENTITY = Transform(_identity, _identity, "identity")
DENSE_KERNEL = Transform(_swap, _swap, "dense")
CONV_KERNEL = Transform(_conv_to_torch, _conv_to_flax, "conv")
CONV_TRANSPOSE_KERNEL = Transform(_convt_to_torch, _convt_to_flax, "conv_transpose")
# Resolved per leaf: by the torch module that owns the key when one is given, else by ndim
# (2: Dense, 3-5: Conv) and by the path (a ConvTranspose in the name: ConvTranspose).
AUTO_KERNEL = Transform(_identity, _identity, "auto kernel")

# A rule: (regex searched in the '/'-joined Flax path, rename template for re.sub, transform).
# The renamed path goes through the naming convention (`/` -> `.`, `name_N` -> `name.N`)
# unless it already contains a '.', in which case it is the torch key verbatim. A plain
# callable as transform is used both ways (it must be its own inverse, like a transpose).
Rule = tuple[str, str, Transform | TensorFn | None]

BUILTIN_RULES: list[Rule] = [
    (r"^(.*/)?kernel$", r"\1weight", AUTO_KERNEL),  # Dense/Conv/ConvTranspose
    (r"^(.*/)?scale$", r"\1weight", None),  # LayerNorm/RMSNorm/GroupNorm/BatchNorm
    (r"^(.*/)?embedding$", r"\1weight", None),  # Embed
    (r"^(.*/)?bias$", r"\1bias", None),
    (r"^(.*/)?mean$", r"\1running_mean", None),  # BatchNorm batch_stats
    (r"^(.*/)?var$", r"\1running_var", None),
]


def as_transform(t: Transform | TensorFn | None) -> Transform:
    """A rule's transform as a :class:`Transform` (a plain callable serves both ways)."""
    if t is None:
        return IDENTITY
    if isinstance(t, Transform):
        return t
    if callable(t):
        return Transform(t, t, getattr(t, "__name__", "custom"))
    raise StateDictError(
        f"A rule's transform must be None, a bridge.Transform or a callable, got {t!r}. "
        "Fix: pass e.g. bridge.Transform(to_torch=..., to_flax=...)."
    )


def kernel_layout(path: str, ndim: int, owner: torch.nn.Module | None) -> Transform:
    """The layout of an ``AUTO_KERNEL`` leaf: by its torch owner, else by ndim and name."""
    if isinstance(owner, torch.nn.modules.conv._ConvTransposeNd):
        return CONV_TRANSPOSE_KERNEL if ndim >= 3 else IDENTITY
    if ndim == 2:
        return DENSE_KERNEL
    if 3 <= ndim <= 5:
        if owner is None and re.search(r"(?i)conv_?transpose|deconv", path):
            return CONV_TRANSPOSE_KERNEL
        return CONV_KERNEL
    return IDENTITY  # no built-in layout: the strict check reports the shape


def torch_name(path: str) -> str:
    """The torch key of a '/'-joined Flax path (``layers_0/kernel`` -> ``layers.0.kernel``)."""
    if "." in path:
        return path
    return ".".join(re.sub(r"^(.*\D)_(\d+)$", r"\1.\2", part) for part in path.split("/"))
