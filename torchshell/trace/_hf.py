"""transformers models as a compiled training step needs them, for the duration of a trace.

Two defaults of transformers do not fit a step that is traced once and run many times:

- **the KV cache**: decoder models (Llama, Qwen2, Mistral, Gemma, OPT, GPT-NeoX, Bart...)
  build a ``DynamicCache`` in every forward while ``config.use_cache`` is on (the default,
  in train mode too) and return it. It is a Python object, not tensors, and a compiled step
  cannot carry it to the next batch; :func:`no_kv_cache` turns the configs' default off;
- **memoized tensors**: helpers under ``compile_compatible_method_lru_cache`` (relative
  position indices of BEiT, Data2VecVision, DPT...) keep the first tensor they return in a
  class-level cache, which outlives the trace and turns up later in plain torch (``net(x)``
  after ``fit`` failed with "torchax Tensors can only do math within the torchax
  environment"). :func:`uncached` makes that decorator compute afresh, as it does under
  ``torch.compile``.

Neither imports transformers: both act only on what is already loaded.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch import nn


def _transformers_config(config: Any) -> bool:
    return any(k.__module__.startswith("transformers.") for k in type(config).__mro__)


@contextlib.contextmanager
def no_kv_cache(module: nn.Module) -> Iterator[None]:
    """``use_cache`` off in the transformers configs of ``module``'s submodules, then back.

    A forward called with ``use_cache=True`` explicitly still returns its cache (and the
    step refuses it as an output that is not tensors).

    Example:
        >>> with no_kv_cache(nn.Linear(2, 2)):
        ...     pass
    """
    configs: dict[int, Any] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", None) is True and _transformers_config(config):
            configs[id(config)] = config
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _compiling() -> bool:
    return True


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """transformers' ``compile_compatible_method_lru_cache`` computes afresh, then back.

    Example:
        >>> with uncached():
        ...     pass
    """
    utils = sys.modules.get("transformers.pytorch_utils")
    before = getattr(utils, "is_torchdynamo_compiling", None)
    if before is None:
        yield
        return
    utils.is_torchdynamo_compiling = _compiling  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils.is_torchdynamo_compiling = before  # type: ignore[union-attr]
