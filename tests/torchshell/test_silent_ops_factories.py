"""``torch.linspace`` / ``logspace`` / ``arange`` with ``out=`` through the trace (issue #52):
torchax refused ``linspace``/``logspace`` of Python numbers into ``out`` with a fix that did
not apply ("device type jax does not match ... (meta)": "write that line with other torch
ops"), and gave ``out`` of one element but another shape the result's shape (``linspace(a, b,
1, out=o)`` of a 0-d ``o``: ``(1,)`` where torch keeps ``()``). torch resizes ``out`` only to
another number of elements, and computes in ``out``'s dtype."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from torchshell.torch_model import torch_model_fns

_FACTORIES: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "linspace_1": lambda o, a: torch.linspace(-2.0, -3, 1, out=o),
    "linspace_0": lambda o, a: torch.linspace(-2.0, -3, 0, out=o),
    "linspace_6": lambda o, a: torch.linspace(0.5, 2, 6, out=o),
    "linspace_tensor_1": lambda o, a: torch.linspace(a[0], a[1], 1, out=o),
    "linspace_tensor_6": lambda o, a: torch.linspace(a[0], 4.0, 6, out=o),
    "logspace_1": lambda o, a: torch.logspace(-2.0, -3, 1, out=o),
    "logspace_6": lambda o, a: torch.logspace(-1, 1, 6, base=2.0, out=o),
    "arange_1": lambda o, a: torch.arange(0.5, 1.0, out=o),
    "arange_6": lambda o, a: torch.arange(0, 3, 0.5, out=o),
}


# (torch eager's own notes when it resizes out; torchax's decompositions of logspace and of
# linspace from tensors cast to float64, which JAX with x64 off notes, out= or not)
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")
@pytest.mark.filterwarnings("ignore:The number of elements in the out tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized:UserWarning")
@pytest.mark.parametrize("shape", [(), (1,), (6,), (2, 3), (0,)])
@pytest.mark.parametrize("factory", sorted(_FACTORIES))
def test_factories_write_into_out_as_torch(factory: str, shape: tuple[int, ...]) -> None:
    _check(_FACTORIES[factory], shape)


@pytest.mark.parametrize("shape", [(6,), (2, 3)])
def test_linspace_into_a_slice_writes_through(shape: tuple[int, ...]) -> None:
    _check(lambda o, a: torch.linspace(1, 2, 2, out=o[:2] if o.ndim == 1 else o[0, :2]), shape)


def _check(make: Callable[[torch.Tensor, torch.Tensor], Any], shape: tuple[int, ...]) -> None:
    class Out(nn.Module):
        def forward(self, o: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            o = o * 1.0  # (a tensor of the step's own)
            make(o, a)
            return o * 2.0

    o, a = torch.full(shape, 9.0), torch.tensor([0.25, 3.0])
    want = Out()(o, a)
    fns = torch_model_fns(Out(), ("o", "a"))
    batch = {"o": jnp.asarray(o.numpy()), "a": jnp.asarray(a.numpy())}
    got = np.asarray(fns.apply({}, {}, batch, jax.random.key(0), True)[0])
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


def test_linspace_into_an_integer_out_computes_in_its_dtype() -> None:
    class Out(nn.Module):
        def forward(self, o: torch.Tensor) -> torch.Tensor:
            q = torch.zeros(4, dtype=torch.long)
            torch.linspace(0, 10, 4, out=q)
            return q + o

    fns = torch_model_fns(Out(), ("o",))
    got = fns.apply({}, {}, {"o": jnp.zeros((), jnp.int32)}, jax.random.key(0), True)[0]
    np.testing.assert_array_equal(np.asarray(got), Out()(torch.tensor(0)).numpy())
