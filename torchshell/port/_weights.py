"""The user's torch weights brought up to date when a host hook reads them.

During ``fit`` the trained weights live in the JAX state; the user's ``LightningModule`` keeps
the torch parameters it was built with. A hook the user runs on the host (``on_train_epoch_end``
reading ``self.net.weight``, ``on_validation_epoch_end`` sampling with ``self(z)``, a batch hook
logging a parameter norm) must see the trained ones, as in plain Lightning. Copying every
weight before every hook would cost a full copy per step for modules whose batch hooks never
look at them, so :func:`synced_on_read` copies on the hook's first read of a parameter or
buffer of the module (attribute access, ``parameters()``/``named_parameters()``/``buffers()``,
``state_dict()``), and not at all when it reads none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["changed_tensors", "synced_on_read", "tensor_versions"]

_READS = ("__getattr__", "_named_members", "state_dict")
_ABSENT = object()


@contextlib.contextmanager
def synced_on_read(module: nn.Module, sync: Callable[[], None]) -> Iterator[None]:
    """While inside, the first read of ``module``'s weights calls ``sync()`` first.

    The classes of ``module`` and its submodules get, for the duration, wrappers of
    ``nn.Module``'s attribute fallback (where parameters and buffers are found),
    ``_named_members`` (behind ``parameters()``, ``buffers()`` and their named forms) and
    ``state_dict``. (On those classes, not on ``nn.Module``: assigning ``__getattr__`` there
    updates every torch module class in the process, ~0.3 ms a hook.)

    Example:
        >>> import torch
        >>> net, calls = torch.nn.Linear(2, 2), []
        >>> with synced_on_read(net, lambda: calls.append(1)):
        ...     _ = net.training  # not a weight
        ...     _ = net.weight, net.bias
        >>> calls, "__getattr__" in torch.nn.Linear.__dict__
        ([1], False)
    """
    owners = {id(m): m for m in module.modules()}
    classes = {type(m) for m in owners.values()}
    pending = [True]
    # what each class has itself (restored after), and what it resolves to now (wrapped)
    own = {(c, name): c.__dict__.get(name, _ABSENT) for c in classes for name in _READS}
    resolved = {(c, name): getattr(c, name) for c in classes for name in _READS}

    def first(owner: Any) -> None:
        if pending[0] and id(owner) in owners:
            pending[0] = False
            restore()  # (the sync itself reads and writes the weights)
            sync()

    def wrap(cls: type, name: str) -> Any:
        original = resolved[cls, name]
        if name != "__getattr__":

            def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                first(self)
                return original(self, *args, **kwargs)

            return method

        def getattr_(self: nn.Module, attr: str) -> Any:
            held = self.__dict__
            if attr in held.get("_parameters", ()) or attr in held.get("_buffers", ()):
                first(self)
            return original(self, attr)

        return getattr_

    def restore() -> None:
        for (cls, name), value in own.items():
            if value is _ABSENT:
                if name in cls.__dict__:
                    delattr(cls, name)
            else:
                setattr(cls, name, value)

    for cls, name in own:
        setattr(cls, name, wrap(cls, name))
    try:
        yield
    finally:
        restore()


def tensor_versions(module: nn.Module) -> dict[str, Any]:
    """A copy of each ``state_dict`` tensor (what :func:`changed_tensors` compares with).

    (Values, not in-place version counters: BatchNorm's kernel updates its running
    statistics without bumping them, and ``p.data.clamp_()`` bumps another tensor's.)

    Example:
        >>> import torch
        >>> net = torch.nn.BatchNorm1d(2)
        >>> before = tensor_versions(net)
        >>> _ = net(torch.randn(4, 2))  # train mode: the running statistics move
        >>> sorted(changed_tensors(net, before))
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    return {k: t.detach().clone() for k, t in module.state_dict().items()}


def changed_tensors(module: nn.Module, versions: dict[str, Any]) -> dict[str, Any]:
    """The ``state_dict`` tensors whose values differ from ``versions``."""
    return {
        k: t
        for k, t in module.state_dict().items()
        if k in versions and not torch.equal(versions[k], t)
    }
