"""``BatchNorm(momentum=None)`` in a traced step: the cumulative moving average, as tensors.

torch's ``_BatchNorm.forward`` turns ``momentum=None`` into ``1.0 / float(
num_batches_tracked)``: a Python number read from a buffer, which a compiled step does not
have (the buffer is traced). While tracing, such a module in train mode normalises with the
batch's statistics and updates its running mean and (unbiased) variance with the factor
``1 / num_batches_tracked`` kept a tensor: torch's values, no host read. Every other
BatchNorm runs torch's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def _cumulative(original: Any) -> Any:
    def forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
        if not (self.momentum is None and self.training and self.track_running_stats):
            return original(self, input)  # type: ignore[no-any-return]
        mean_, var_, count = self.running_mean, self.running_var, self.num_batches_tracked
        if mean_ is None or var_ is None or count is None:
            return original(self, input)  # type: ignore[no-any-return]
        self._check_input_dim(input)
        count.add_(1)
        factor = 1.0 / count.to(input.dtype)
        dims = [0, *range(2, input.dim())]
        n = input.numel() // input.size(1)
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        with torch.no_grad():
            mean = input.mean(dims)
            var = input.var(dims, unbiased=False) * (n / max(n - 1, 1))
            mean_.copy_(mean_ + factor * (mean - mean_))
            var_.copy_(var_ + factor * (var - var_))
        return out

    return forward


@contextlib.contextmanager
def cumulative_batch_norm() -> Iterator[None]:
    """While tracing, ``BatchNorm*d(momentum=None)`` in train mode updates its running
    statistics with tensor arithmetic (the module's class is left as it was after).

    Example:
        >>> bn = torch.nn.BatchNorm1d(2, momentum=None)
        >>> with cumulative_batch_norm():
        ...     _ = bn(torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
        >>> bn.running_mean.tolist(), int(bn.num_batches_tracked)
        ([1.0, 2.0], 1)
    """
    original = _BatchNorm.forward
    _BatchNorm.forward = _cumulative(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        _BatchNorm.forward = original  # type: ignore[method-assign]
