"""Python's and numpy's random draws refused while a step is traced.

A step is traced once and compiled: ``lam = np.random.beta(a, a)`` (mixup, cutmix) or
``random.random() < p`` in ``training_step`` would draw one number at trace time and the
compiled step would reuse it on every batch, silently. torch's own draws (``torch.rand``,
``torch.randperm``, ``torch.distributions.Beta(a, a).sample()``) are traced and draw anew
each step, so the refusal names them.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from torchshell._errors import TorchModelError

# module-level draw functions (numpy's legacy global RandomState, Python's global Random)
_NUMPY = (
    "beta", "binomial", "choice", "dirichlet", "exponential", "gamma", "normal",
    "permutation", "poisson", "rand", "randint", "randn", "random", "random_sample",
    "shuffle", "standard_normal", "uniform",
)  # fmt: skip
_PYTHON = (
    "betavariate", "choice", "choices", "gauss", "normalvariate", "randint", "random",
    "randrange", "sample", "shuffle", "uniform",
)  # fmt: skip


def _caller() -> tuple[str, bool]:
    """``(file:line, whether it is a library's)`` of the call that drew."""
    frame = sys._getframe(2)
    name = frame.f_code.co_filename
    return f"{name}:{frame.f_lineno}", "site-packages" in name or "dist-packages" in name


def _refused(name: str) -> Callable[..., Any]:
    def draw(*args: Any, **kwargs: Any) -> Any:
        where, library = _caller()
        fix = (
            "Fix: this draw is in a library's layer: turn off the option that draws it in "
            "training (transformers' wav2vec2/HuBERT: config.layerdrop=0.0, "
            "mask_time_prob=0.0, mask_feature_prob=0.0), or apply that augmentation in the "
            "collate or on_before_batch_transfer."
            if library
            else "Fix: draw with torch inside the step, which draws anew each step "
            "(torch.distributions.Beta(a, a).sample() for mixup's lambda, torch.rand(()), "
            "torch.randint, torch.randperm), or draw on the host in on_train_batch_start "
            "and pass the value in the batch."
        )
        raise TorchModelError(
            f"{name}() was called while the step is traced (at {where}): it would draw one "
            "number when the step is compiled, and the compiled step would reuse that "
            f"number on every batch. {fix}"
        )

    return draw


@contextlib.contextmanager
def host_random_refused() -> Iterator[None]:
    """For its duration, numpy's and Python's global random draws raise a
    :class:`TorchModelError` naming the call and the fix.

    Example:
        >>> import numpy as np
        >>> with host_random_refused():
        ...     np.random.beta(0.4, 0.4)
        Traceback (most recent call last):
        ...
        torchshell._errors.TorchModelError: np.random.beta() was called while the step ...
        >>> 0.0 <= float(np.random.beta(0.4, 0.4)) <= 1.0
        True
    """
    saved = [(np.random, n, getattr(np.random, n)) for n in _NUMPY]
    saved += [(random, n, getattr(random, n)) for n in _PYTHON]
    try:
        for module, name, _ in saved:
            prefix = "np.random" if module is np.random else "random"
            setattr(module, name, _refused(f"{prefix}.{name}"))
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
