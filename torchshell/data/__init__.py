"""Torch data modules of the recipes, and the loader settings JAX needs."""

from torchshell.data._loader import batch_collate, loader_kwargs

__all__ = ["batch_collate", "loader_kwargs"]
