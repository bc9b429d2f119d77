"""Torch data modules of the recipes, and the loader settings JAX needs."""

from torchshell.data._loader import (
    DrainingDataLoader,
    batch_collate,
    forking_loaders,
    loader_kwargs,
    loaders_in,
    stop_workers,
)
from torchshell.data._sampler import eval_shard, real_rows, shard_sampler

__all__ = [
    "DrainingDataLoader",
    "batch_collate",
    "eval_shard",
    "forking_loaders",
    "loader_kwargs",
    "loaders_in",
    "real_rows",
    "shard_sampler",
    "stop_workers",
]
