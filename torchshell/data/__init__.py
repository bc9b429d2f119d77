"""Torch data modules of the recipes, and the loader settings JAX needs."""

from torchshell.data._loader import batch_collate, loader_kwargs, stop_workers

__all__ = ["batch_collate", "loader_kwargs", "stop_workers"]
