"""Loading torchax under a torch that lacks an op overload torchax names.

torchax 0.0.13 names some aten overloads at import time, in tables (``torchax/amp.py``'s
autocast policies, ``torchax/decompositions.py``'s decomposition list): for example
``aten.prod.dim_Dimname``, ``aten.all.dimname``, ``aten.index_add.dimname``,
``aten.norm.names_*``. torch 2.13 (the only torch on a TPU VM's wheels) dropped those named-
dimension overloads, so ``import torchax`` stops with ``AttributeError: The underlying op of
'aten.prod' has no overload name 'dim_Dimname'`` and nothing can be traced.

Here, while torchax's own modules execute (and only then: ``torchax.decompositions`` is
imported lazily, when the first ``Environment`` is built, so every torchax module counts), an
overload the running torch
lacks reads as an inert :class:`MissingOverload` key instead of raising: a table entry for an
op that cannot be dispatched anyway, never called. Everything else behaves as before: the
first attribute error outside torchax's import, or for a private name, still raises.
:func:`install` puts a one-shot import hook on ``sys.meta_path`` (``torchshell.trace`` calls
it when imported), so torchax is still imported only by the code that traces, whoever
imports it first; :func:`missing` lists what was tolerated.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import torch

__all__ = ["MissingOverload", "install", "missing", "tolerant_overloads"]

_MISSING: list[MissingOverload] = []


class MissingOverload:
    """An overload torchax names that the running torch lacks: a unique, inert table key.

    Example:
        >>> key = MissingOverload("aten::prod", "dim_Dimname")
        >>> key.name(), {key: 1}[key]
        ('aten::prod.dim_Dimname', 1)
    """

    def __init__(self, packet: str, overload: str) -> None:
        self._qualified = f"{packet}.{overload}"

    def name(self) -> str:
        """The overload's qualified name, as ``torch._ops.OpOverload.name()`` gives it."""
        return self._qualified

    def __repr__(self) -> str:
        return f"MissingOverload({self._qualified!r})"


@contextlib.contextmanager
def tolerant_overloads() -> Iterator[list[MissingOverload]]:
    """Within the block, a missing public overload of an op packet reads as a
    :class:`MissingOverload` (collected in the list yielded) instead of raising.

    Example:
        >>> with tolerant_overloads() as seen:
        ...     key = torch.ops.aten.prod.no_such_overload
        >>> [k.name() for k in seen]
        ['aten::prod.no_such_overload']
        >>> torch.ops.aten.prod.no_such_overload  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        AttributeError: ...
    """
    packet_cls = torch._ops.OpOverloadPacket
    original = packet_cls.__getattr__
    seen: list[MissingOverload] = []

    def lenient(packet: Any, key: str) -> Any:
        try:
            return original(packet, key)
        except AttributeError:
            if key.startswith("_"):
                raise
            seen.append(MissingOverload(packet._qualified_op_name, key))
            return seen[-1]

    packet_cls.__getattr__ = lenient  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        packet_cls.__getattr__ = original  # type: ignore[method-assign]


class _TolerantLoader(importlib.abc.Loader):
    """Runs a torchax module under :func:`tolerant_overloads` (every one: torchax imports
    some lazily, e.g. ``torchax.decompositions`` when its first ``Environment`` is built)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with tolerant_overloads() as seen:
            self._loader.exec_module(module)
        _MISSING.extend(seen)


class _TorchaxFinder(importlib.abc.MetaPathFinder):
    """Finds ``torchax`` and its modules as the other finders do, and hands each a
    :class:`_TolerantLoader`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchax" and not fullname.startswith("torchax."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _TolerantLoader(spec.loader)  # type: ignore[arg-type]
                return spec
        return None


def install() -> None:
    """Puts the torchax import hook first on ``sys.meta_path`` (once).

    Example:
        >>> install(); install()
        >>> sum(isinstance(f, _TorchaxFinder) for f in sys.meta_path) <= 1
        True
    """
    if any(isinstance(f, _TorchaxFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchaxFinder())


def missing() -> list[str]:
    """The overloads torchax named that this torch lacks (tolerated at its import).

    Example:
        >>> import torchax  # with torch 2.9.1 nothing is missing
        >>> isinstance(missing(), list)
        True
    """
    return [key.name() for key in _MISSING]
