"""torchshell: the PyTorch side users touch — Lightning module, data, tracking, export, CLI."""

from torchshell.module import JaxModule

__all__ = ["JaxModule"]
