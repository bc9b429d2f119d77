"""torch's own op database (``op_db``) through the trace: a fixed, representative share.

Each op's first two samples with non-empty tensors become a module whose differentiable
tensors are parameters (the other tensors batch fields: int64 ones reach the step as int32,
as coreshell hands them over) and whose loss is ``(out * w).sum()`` with a fixed ``w``. The
traced loss and every gradient (``torch_model_fns`` + ``jax.value_and_grad``, what the
train step differentiates) must equal torch eager's (float32, rtol 1e-4, atol 1e-5), or the
trace must refuse with coreshell's message (``TorchModelError``). Never silently different
(issue #52; docs/torch_model.md). The ops include each one the whole database once found
silently different.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns

pytest.importorskip("expecttest")  # (torch's op database imports it)
from torch.testing._internal.common_methods_invocations import op_db

# (name, variant): found silently different before, then a spread of what models use
OPS = [
    *(("polygamma", f"polygamma_n_{n}") for n in range(5)),
    ("special.polygamma", "special_polygamma_n_0"),
    ("digamma", ""),
    ("special.log_ndtr", ""),
    ("linalg.lstsq", ""),
    ("native_batch_norm", ""),
    ("_native_batch_norm_legit", ""),
    ("take_along_dim", ""),
    ("mvlgamma", "mvlgamma_p_3"),
    ("index_add", ""),
    ("index_copy", ""),
    ("index_fill", ""),
    *(("index_reduce", mode) for mode in ("prod", "mean", "amax", "amin")),
    ("add", ""),
    ("matmul", ""),
    ("log_softmax", ""),
    ("softmax", ""),
    ("nn.functional.layer_norm", ""),
    ("nn.functional.conv2d", ""),
    ("nn.functional.cross_entropy", ""),
    ("nn.functional.gelu", ""),
    ("gather", ""),
    ("scatter_add", ""),
    ("cumsum", ""),
    ("where", ""),
    ("var", ""),
    ("linalg.solve", ""),
    ("cat", ""),
    ("nn.functional.embedding", ""),
    ("nn.functional.max_pool2d", ""),
    ("nn.functional.pad", "reflect"),
    ("masked_fill", ""),
    ("lerp", ""),
    ("logsumexp", ""),
]


class _Sample(nn.Module):
    """``op(input, *args, **kwargs)`` with the differentiable tensors as parameters."""

    def __init__(self, op: Any, leaves: list[Any], spec: Any, grad: list[int]) -> None:
        super().__init__()
        self.op, self.leaves, self.spec, self.grad = op, leaves, spec, grad
        self.ps = nn.ParameterList([nn.Parameter(leaves[i].detach().clone()) for i in grad])

    def forward(self, *fields: torch.Tensor) -> list[torch.Tensor]:
        given, params = iter(fields), iter(self.ps)
        leaves = [
            next(params)
            if i in self.grad
            else (next(given) if isinstance(leaf, torch.Tensor) else leaf)
            for i, leaf in enumerate(self.leaves)
        ]
        x, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.op(x, *args, **kwargs)
        outs = out if isinstance(out, tuple | list) else [out]  # (the first: the values)
        return [o for o in outs[:1] if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _samples(op: Any) -> list[Any]:
    found = []
    for sample in op.sample_inputs("cpu", torch.float32, requires_grad=True):
        tensors = [t for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))]
        if all(t.numel() > 0 for t in tensors if isinstance(t, torch.Tensor)):
            found.append(sample)
        if len(found) == 2:
            return found
    return found


def _compare(op: Any, sample: Any) -> str | None:
    """None where the trace equals torch or refuses with coreshell's message; else what
    differs."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    grad = [
        i
        for i, t in enumerate(leaves)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    net = _Sample(op, leaves, spec, grad)
    fields = [
        t.detach() for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and i not in grad
    ]
    outs = net(*fields)
    g = torch.Generator().manual_seed(0)
    ws = [torch.rand(o.shape, generator=g) + 0.5 for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, ws, strict=True))
    want = torch.autograd.grad(loss, list(net.ps), allow_unused=True) if net.ps else ()
    names = tuple(f"f{i}" for i in range(len(fields)))
    try:
        fns = torch_model_fns(net, names)
        batch = {n: jnp.asarray(t.numpy()) for n, t in zip(names, fields, strict=True)}
        params = {f"ps.{i}": jnp.asarray(p.detach().numpy()) for i, p in enumerate(net.ps)}
        state: dict[str, jax.Array] = {}  # (no buffers: init, another trace, is not needed)

        def traced(p: dict[str, jax.Array]) -> jax.Array:
            got = fns.apply(p, state, batch, jax.random.key(0), True)[0]
            return sum((o * jnp.asarray(w.numpy())).sum() for o, w in zip(got, ws, strict=True))

        value, grads = jax.value_and_grad(traced)(params)
    except TorchModelError:
        return None  # refused with coreshell's message
    wrong = []

    def close(a: Any, b: Any) -> bool:
        return bool(np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True))

    if not close(float(value), float(loss)):
        wrong.append(f"loss {float(value)} != {float(loss)}")
    for i, w in enumerate(want):
        w_ = np.zeros(net.ps[i].shape) if w is None else w.numpy()
        got = np.asarray(grads[f"ps.{i}"])
        if got.shape != w_.shape or not close(got, w_):
            wrong.append(f"gradient of input {grad[i]}: {got.ravel()[:4]} != {w_.ravel()[:4]}")
    return "; ".join(wrong) or None


@pytest.mark.filterwarnings("ignore")  # (torch's samples and JAX's x64-off casts warn)
def test_op_database_share_is_never_silently_different() -> None:
    by_name = {(op.name, op.variant_test_name): op for op in op_db}
    missing = [key for key in OPS if key not in by_name]
    assert not missing, f"not in this torch's op_db: {missing}"
    wrong = []
    for key in OPS:
        op = by_name[key]
        for k, sample in enumerate(_samples(op)):
            found = _compare(op.op, sample)
            if found:
                wrong.append(f"{'.'.join(filter(None, key))} sample {k}: {found}")
    assert not wrong, "silently different from torch:\n" + "\n".join(wrong)
