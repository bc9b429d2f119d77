"""Torch twin of :class:`jaxcore.models.digits.MLP` (same names: ``layers.i``, ``head``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """ReLU MLP classifier with the Flax MLP's layer names.

    Example:
        >>> import torch
        >>> MLP(64, features=(16,))(torch.ones(2, 64)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        in_features: int = 64,
        features: Sequence[int] = (256, 256),
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        widths = [in_features, *features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(widths[-1], num_classes)

    def example_input(self, batch: int = 2) -> torch.Tensor:
        """A sample input for tracing and ONNX export: float32 ``[batch, in_features]``."""
        return torch.randn(batch, self.in_features, generator=torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, in_features]
        for layer in self.layers:
            x = self.dropout(torch.relu(layer(x)))
        return self.head(x)  # [B, num_classes]
