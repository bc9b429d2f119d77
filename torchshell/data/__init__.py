"""Torch data modules of the recipes, and the loader settings JAX needs."""

from torchshell.data._loader import loader_kwargs

__all__ = ["loader_kwargs"]
