"""``batch_idx`` as a traced step hook sees it: 0, refusing to be computed with.

The compiled step is traced once, for every batch: a value or a decision computed from
``batch_idx`` (a loss weighted by it, ``if (batch_idx + 1) % N == 0: opt.step()``, a
``validation_step``'s ``if batch_idx == 0:``) would be the one of batch 0, silently kept for
every batch, where plain Lightning passes 0, 1, 2, ... So any arithmetic, comparison, truth
test or conversion of it raises :class:`ConfigError` naming ``batch_idx``, the hook and the
fix, when the first batch is traced (before any update). Passing it along, or printing it,
still works.
"""

from __future__ import annotations

from typing import Any

from torchshell._errors import ConfigError

__all__ = ["BatchIdx"]


class BatchIdx(int):
    """``batch_idx`` in a traced step hook: 0, refusing to be computed with.

    Args:
        owner: the user's module's class name (for the message).
        manual: the module steps its optimizers itself (the fix differs).
        hook: the traced hook (``training_step``, ``validation_step``, ...).

    Example:
        >>> idx = BatchIdx("Net", manual=False)
        >>> idx + 1
        Traceback (most recent call last):
        ...
        torchshell._errors.ConfigError: Net.training_step computes with batch_idx ...
    """

    owner: str
    manual: bool
    hook: str

    def __new__(
        cls, owner: str = "the module", *, manual: bool = False, hook: str = "training_step"
    ) -> BatchIdx:
        idx = super().__new__(cls, 0)
        idx.owner, idx.manual, idx.hook = owner, manual, hook
        return idx

    def _refuse(self, *args: Any) -> Any:
        if self.hook != "training_step":
            stage = self.hook.removesuffix("_step")
            raise ConfigError(
                f"{self.owner}.{self.hook} computes with batch_idx (e.g. `if batch_idx == 0:` "
                "or `batch_idx * n`): the compiled evaluation step is traced once for every "
                "batch, so it would see batch_idx=0 for every batch, where plain Lightning "
                "passes 0, 1, 2, .... Fix: move per-batch host work (logging images of the "
                f"first batch) to on_{stage}_batch_end(outputs, batch, batch_idx), which gets "
                "the real batch_idx and the step's outputs; compute values from a batch field "
                "(an index your Dataset returns)."
            )
        if self.manual:
            raise ConfigError(
                f"{self.owner}.training_step computes with batch_idx under manual "
                "optimization (e.g. `if (batch_idx + 1) % N == 0: opt.step()`): the compiled "
                "step is traced once for every batch, so a decision on batch_idx would be "
                "taken once, for batch 0. Fix: step the optimizers every batch; to accumulate "
                "gradients over N batches, use automatic optimization with "
                "Trainer(accumulate_grad_batches=N), or pass a larger batch."
            )
        raise ConfigError(
            f"{self.owner}.training_step computes with batch_idx (e.g. `loss * (batch_idx + "
            "1)` or `if batch_idx % N == 0:`): the compiled step is traced once for every "
            "batch, so it would see batch_idx=0 for every batch, where plain Lightning passes "
            "0, 1, 2, .... Fix: compute such a value from a batch field (an index your "
            "Dataset returns), or move per-batch host work (printing, image logging) to "
            "on_train_batch_start/on_train_batch_end, which get the real batch_idx."
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = _refuse
    __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = __divmod__ = __rdivmod__ = _refuse
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _refuse
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = __invert__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _refuse  # type: ignore[assignment]
    __index__ = __int__ = __float__ = __round__ = __trunc__ = __floor__ = __ceil__ = _refuse  # type: ignore[assignment]
    __hash__ = int.__hash__

    def __reduce__(self) -> Any:  # (a copy is a plain 0: deepcopy/pickle need no refusal)
        return (int, (0,))
