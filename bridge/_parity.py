"""Forward parity of a JAX function and a torch module on the same inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch

from bridge._convert import as_numpy, as_torch
from bridge._errors import ParityError
from bridge._tree import PyTree, path_str


@dataclass(frozen=True)
class OutputParity:
    """Errors of one output leaf: max abs error, max rel error (over nonzero references)."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool


@dataclass(frozen=True)
class ParityReport:
    """Per-output errors of :func:`check_parity`; ``ok`` when every output is within tolerance.

    Example:
        >>> r = ParityReport([OutputParity("out", (2,), 0.0, 0.0, True)], rtol=1e-5, atol=1e-5)
        >>> r.ok, r.max_abs
        (True, 0.0)
    """

    outputs: list[OutputParity]
    rtol: float
    atol: float

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    def __str__(self) -> str:
        rows = [f"parity (rtol={self.rtol:g}, atol={self.atol:g}):"]
        rows += [
            f"  {o.name} {o.shape}: max abs {o.max_abs:.3e}, max rel {o.max_rel:.3e}"
            + ("" if o.ok else "  OUT OF TOLERANCE")
            for o in self.outputs
        ]
        return "\n".join(rows)

    def raise_for_mismatch(self) -> None:
        """Raises :class:`~bridge.ParityError` with the report when an output is off."""
        if not self.ok:
            raise ParityError(
                f"JAX and torch outputs differ beyond tolerance.\n{self}\nFix: check the "
                "layer layouts (bridge.export_state_dict with the torch module is strict), "
                "eval mode (dropout, BatchNorm running stats), epsilons and activations."
            )


def _leaf_names(tree: PyTree) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path_str(p) or "output", x) for p, x in flat]


def _to_torch(x: Any) -> Any:
    """Array inputs as fresh torch tensors (the module may write into them); others as are."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return as_torch(np.array(as_numpy(x), copy=True))
    return x


def check_parity(
    jax_apply: Callable[..., PyTree],
    params: PyTree,
    torch_module: torch.nn.Module,
    inputs: Sequence[Any],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> ParityReport:
    """Runs ``jax_apply(params, *inputs)`` and ``torch_module(*inputs)``; compares outputs.

    Inputs (numpy, JAX or torch arrays) are handed to each side in its own type; outputs are
    matched leaf by leaf (same pytree structure, e.g. a tensor or a tuple of tensors). The
    torch module runs as it is (put it in ``eval()`` yourself) under ``torch.no_grad()``.
    An output passes when ``|jax - torch| <= atol + rtol * |torch|`` everywhere.

    Args:
        jax_apply: e.g. ``model.apply`` or ``lambda v, x: model.apply(v, x.transpose(...))``.
        params: its first argument (variables dict, params tree, nnx State...).
        torch_module: the torch model.
        inputs: positional inputs, the same values for both.
        rtol: relative tolerance.
        atol: absolute tolerance.

    Returns:
        A :class:`ParityReport`; call ``.raise_for_mismatch()`` to fail on it.

    Raises:
        ParityError: the two sides return different structures or shapes.

    Example:
        >>> import jax.numpy as jnp, numpy as np, torch
        >>> lin = torch.nn.Linear(3, 2)
        >>> w, b = (jnp.asarray(t.detach().numpy()) for t in (lin.weight, lin.bias))
        >>> x = np.ones((4, 3), np.float32)
        >>> report = check_parity(lambda p, x: x @ p[0].T + p[1], (w, b), lin, [x])
        >>> report.ok
        True
    """
    if not isinstance(inputs, (list, tuple)):
        raise ParityError(
            f"inputs must be a list or tuple of positional inputs, got {type(inputs).__name__}. "
            "Fix: wrap a single input as [x]."
        )
    jax_out = jax_apply(params, *(jax.numpy.asarray(as_numpy(x)) for x in inputs))
    with torch.no_grad():
        torch_out = torch_module(*(_to_torch(x) for x in inputs))
    ours, theirs = _leaf_names(jax_out), _leaf_names(torch_out)
    if len(ours) != len(theirs):
        raise ParityError(
            f"The JAX side returned {len(ours)} outputs ({[n for n, _ in ours]}), the torch "
            f"side {len(theirs)} ({[n for n, _ in theirs]}). Fix: make both return the same "
            "structure (wrap one side in a lambda)."
        )
    results = []
    for (name, a), (_, b) in zip(ours, theirs, strict=True):
        a64, b64 = as_numpy(a).astype(np.float64), as_numpy(b).astype(np.float64)
        if a64.shape != b64.shape:
            raise ParityError(
                f"Output {name}: JAX shape {a64.shape} vs torch shape {b64.shape}. Fix: check "
                "the layouts of inputs and outputs (channels-last in Flax, channels-first in "
                "torch) in jax_apply."
            )
        diff = np.abs(a64 - b64)
        ref = np.abs(b64)
        nonzero = ref > 0
        max_rel = float(np.max(diff[nonzero] / ref[nonzero])) if nonzero.any() else 0.0
        results.append(
            OutputParity(
                name,
                a64.shape,
                float(diff.max(initial=0.0)),
                max_rel,
                bool(np.all(diff <= atol + rtol * ref)),
            )
        )
    return ParityReport(results, rtol, atol)
