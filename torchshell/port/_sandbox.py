"""The trace sandbox: every patch the port makes on objects it does not own, always undone.

While a user's ``LightningModule`` hook is traced, some of what it reads or calls must give
the trace's values, not the host's: Lightning's ``Trainer`` properties ``is_last_batch``,
``current_epoch`` and ``global_step`` (:mod:`torchshell.port._host_reads`), the module's own
``global_step``/``current_epoch`` (its class, worn for the trace:
:func:`~torchshell.port._logs._counting_class`), ``self.log``, ``self.device``, its
torchmetrics objects' ``forward``/``update``/``compute`` and its optimizers' param groups
(:mod:`torchshell.port._capture`). When the port runs the user's own hooks on the host,
``self.log`` is the ``JaxModule``'s (:mod:`torchshell.port._hooks`).

All of them go through a :class:`TraceSandbox`: each patch is installed at once and recorded
with what it replaced; when the sandbox closes every one is put back, in reverse order, also
after an exception (one failing restore does not stop the others). Sandboxes nest: one
opened inside another (the same object entered again, or a new one) puts back the values the
outer one had installed. Only attributes the sandbox patched are touched, so after a fit the
user's module and ``lightning.Trainer`` hold exactly what they held before (class,
properties, instance attributes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, MutableSequence
from types import TracebackType
from typing import Any, cast

import lightning as L

__all__ = ["TraceSandbox"]


class TraceSandbox:
    """Patches installed now and put back when the sandbox closes (see the module docstring).

    Example:
        >>> class Box:
        ...     size = 1
        >>> box = Box()
        >>> with TraceSandbox() as sandbox:
        ...     sandbox.patch(box, "size", 2)
        ...     sandbox.patch(box, "colour", "red")
        ...     (box.size, box.colour)
        (2, 'red')
        >>> box.size, "colour" in vars(box), "size" in vars(box)
        (1, False, False)
    """

    def __init__(self) -> None:
        self._open: list[contextlib.ExitStack] = []  # one per `with`, innermost last

    def __enter__(self) -> TraceSandbox:
        self._open.append(contextlib.ExitStack())
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> bool:
        return bool(self._open.pop().__exit__(kind, error, trace))

    def _undo(self, restore: Callable[[], Any]) -> None:
        if not self._open:
            restore()  # (installed nothing worth keeping: undone before raising)
            raise RuntimeError("TraceSandbox.patch outside `with TraceSandbox() as sandbox:`.")
        self._open[-1].callback(restore)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value`` until the sandbox closes: an instance attribute (removed
        again if the instance had none of its own) or a class attribute (``owner`` a class).

        ``name="__class__"`` makes an instance wear another class (:meth:`wear_class`).
        """
        if name == "__class__":
            before: Any = type(owner)
            setattr(owner, name, value)
            self._undo(lambda: setattr(owner, name, before))
            return
        held = vars(owner)
        if name in held:
            before = held[name]
            setattr(owner, name, value)
            self._undo(lambda: setattr(owner, name, before))
        else:
            setattr(owner, name, value)
            self._undo(lambda: delattr(owner, name) if name in vars(owner) else None)

    def patch_item(self, container: MutableSequence[Any], index: int, value: Any) -> None:
        """``container[index] = value`` until the sandbox closes (an optimizer's param group)."""
        before = container[index]
        container[index] = value
        self._undo(lambda: container.__setitem__(index, before))

    def wear_class(self, obj: Any, cls: type) -> None:
        """``obj`` is an instance of ``cls`` (a subclass of its own class) until the sandbox
        closes: the user's module while its step is traced."""
        if cls.__mro__[1] is not type(obj):
            raise TypeError(f"{cls.__name__} is not a subclass of {type(obj).__name__}'s class.")
        self.patch(obj, "__class__", cls)

    def trainer_property(self, name: str, get: Callable[[Any], Any]) -> None:
        """``lightning.Trainer.name`` reads ``get(trainer)`` until the sandbox closes (every
        Trainer: the property lives on the class)."""
        if not isinstance(vars(L.Trainer).get(name), property):
            raise AttributeError(f"lightning.Trainer has no property {name!r} to watch.")
        self.patch(L.Trainer, name, property(get))

    @staticmethod
    def trainer_getter(name: str) -> Callable[[Any], Any]:
        """``lightning.Trainer``'s own getter of property ``name`` (what a patched one reads
        through to)."""
        return cast(Callable[[Any], Any], vars(L.Trainer)[name].fget)
