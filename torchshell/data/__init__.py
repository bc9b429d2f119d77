"""Torch data modules of the recipes, and the loader settings JAX needs."""

from torchshell.data._loader import (
    DrainingDataLoader,
    batch_collate,
    forking_loaders,
    loader_kwargs,
    loaders_in,
    stop_workers,
)

__all__ = [
    "DrainingDataLoader",
    "batch_collate",
    "forking_loaders",
    "loader_kwargs",
    "loaders_in",
    "stop_workers",
]
