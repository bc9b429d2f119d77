"""``nn.AdaptiveLogSoftmaxWithLoss`` in a traced step, with fixed shapes.

torch's forward splits the batch by cluster with ``target_mask.nonzero()`` (shapes that
depend on the targets' values), so a compiled step could not trace it and the refusal
pointed into torch's own code. While tracing, the module's forward takes each target's
log-probability from the full distribution instead (the head's ``log_softmax`` for
shortlist ids; the head's cluster entry plus the cluster's ``log_softmax`` for the rest,
every cluster run on every row): torch's values and gradients (a row's gradient reaches only
its own cluster), ``loss = -output.mean()``. Targets outside ``[0, n_classes)``, which torch
refuses with ``RuntimeError``, are refused by the step's input check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jaxcore.guard import index_check

_OUT_OF_RANGE = (
    "nn.AdaptiveLogSoftmaxWithLoss got the target {{value}} {{where}}; torch raises "
    "RuntimeError: Target values should be in [0, {last}]. Fix: map the targets into the "
    "module's n_classes in the Dataset, or build it with n_classes > {{value}}."
)


def _full_log_prob(module: nn.AdaptiveLogSoftmaxWithLoss, input: torch.Tensor) -> torch.Tensor:
    head = F.log_softmax(module.head(input), dim=1)
    parts = [head[:, : module.shortlist_size]]
    for i, cluster in enumerate(module.tail):
        entry = head[:, module.shortlist_size + i].unsqueeze(1)
        parts.append(F.log_softmax(cluster(input), dim=1) + entry)
    return torch.cat(parts, dim=1)


def _fixed_shape(original: Any) -> Any:
    def forward(self: nn.AdaptiveLogSoftmaxWithLoss, input_: Any, target_: Any) -> Any:
        if target_.dim() not in (0, 1) or input_.dim() != target_.dim() + 1:
            return original(self, input_, target_)  # (torch's own shape errors)
        batched = target_.dim() == 1
        input = input_ if batched else input_.unsqueeze(0)
        target = target_ if batched else target_.unsqueeze(0)
        if input.size(0) != target.size(0):
            return original(self, input_, target_)
        elem = getattr(target, "_elem", None)
        if elem is not None:
            index_check(elem, self.n_classes, _OUT_OF_RANGE.format(last=self.n_classes - 1))
        output = _full_log_prob(self, input).gather(1, target.unsqueeze(1)).squeeze(1)
        loss = (-output).mean()
        return nn.modules.adaptive._ASMoutput(output if batched else output.squeeze(0), loss)

    return forward


@contextlib.contextmanager
def adaptive_softmax_fixed_shape() -> Iterator[None]:
    """While tracing, ``nn.AdaptiveLogSoftmaxWithLoss.forward`` needs no value-dependent
    shapes (the class is left as it was after).

    Example:
        >>> torch.manual_seed(0) and None
        >>> asm = nn.AdaptiveLogSoftmaxWithLoss(8, 6, cutoffs=[2, 4], div_value=2.0)
        >>> x, y = torch.randn(3, 8), torch.tensor([0, 3, 5])
        >>> want = asm(x, y).loss
        >>> with adaptive_softmax_fixed_shape():
        ...     got = asm(x, y).loss
        >>> bool(torch.allclose(got, want))
        True
    """
    original = nn.AdaptiveLogSoftmaxWithLoss.forward
    nn.AdaptiveLogSoftmaxWithLoss.forward = _fixed_shape(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.AdaptiveLogSoftmaxWithLoss.forward = original  # type: ignore[method-assign]
