"""``torch.linalg.eigh``, ``eigvalsh`` and ``pinv`` through the trace (issue #52): torch reads
one triangle of the input (``UPLO``), JAX symmetrised it, so on a matrix nobody symmetrised
the values differed, silently; torch's gradient reaches the whole input (the Hermitian part
of its ``eigh`` backward; ``pinv_backward`` for ``pinv``), and so does the trace's. torchax's
``pinv`` also dropped ``atol`` and ``hermitian``. Values and gradients against torch eager,
random non-symmetric (and symmetric) matrices, both triangles.

Eigenvectors are compared through functions that do not depend on their signs (torch says
each is unique up to sign, and the sign is the LAPACK build's): ``V diag(tanh(w)) V^T`` and
``|V|``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from tests.torchshell.test_silent_ops import _differences
from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns

_G = torch.Generator().manual_seed(1)  # (each triangle's eigenvalues 0.9 apart, |w| > 0.18)
_SQUARE = torch.randn(5, 5, generator=_G)  # (not symmetric)
_BATCH = torch.randn(2, 4, 4, generator=_G)
_SYMMETRIC = _SQUARE + _SQUARE.T


def _eigvalsh(uplo: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda a: torch.linalg.eigvalsh(a, UPLO=uplo)


def _eigh_values(uplo: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda a: torch.linalg.eigh(a, UPLO=uplo).eigenvalues


def _eigh_rebuilt(uplo: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``V diag(tanh(w)) V^T``: eigenvalues and eigenvectors, whatever their signs."""

    def run(a: torch.Tensor) -> torch.Tensor:
        w, v = torch.linalg.eigh(a, UPLO=uplo)
        return (v * torch.tanh(w).unsqueeze(-2)) @ v.mT

    return run


def _eigh_magnitudes(uplo: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda a: torch.linalg.eigh(a, UPLO=uplo)[1].abs()


def _method(uplo: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda a: torch.linalg.eigvalsh(a * 2.0, uplo.lower())  # (torch takes 'l'/'u')


@pytest.mark.parametrize("matrix", [_SQUARE, _BATCH, _SYMMETRIC], ids=["square", "batch", "sym"])
@pytest.mark.parametrize("uplo", ["L", "U"])
@pytest.mark.parametrize("op", [_eigvalsh, _eigh_values, _eigh_rebuilt, _eigh_magnitudes, _method])
def test_eigh_reads_one_triangle_as_torch(op: Any, uplo: str, matrix: torch.Tensor) -> None:
    assert not _differences(op(uplo), [matrix])


def test_eigh_of_a_wrong_triangle_name_is_refused_naming_the_fix() -> None:
    class Eig(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._linalg_eigh(a, "X")[0]

    fns = torch_model_fns(Eig(), ("a",))
    with pytest.raises(TorchModelError, match=r"UPLO='X'.*Fix: pass UPLO='L'"):
        fns.apply({}, {}, {"a": jnp.eye(3)}, jax.random.key(0), True)


_PINVS = {
    "hermitian": lambda a: torch.linalg.pinv(a, hermitian=True),
    "hermitian_atol": lambda a: torch.linalg.pinv(a, hermitian=True, atol=0.8),
    "hermitian_rcond": lambda a: torch.linalg.pinv(a, 0.3, True),
    "plain": torch.linalg.pinv,
    "atol": lambda a: torch.linalg.pinv(a, atol=1.0),  # (torchax dropped atol)
    "atol_tensor": lambda a: torch.linalg.pinv(a, atol=torch.tensor(1.0)),
    "rtol": lambda a: torch.linalg.pinv(a, rtol=0.4),
    "rcond": lambda a: torch.linalg.pinv(a, 0.4),
    "pinverse": lambda a: torch.pinverse(a, 0.3),
    "method": lambda a: a.pinverse(),
    "tall": lambda a: torch.linalg.pinv(a[..., :3], atol=0.5),
    "wide": lambda a: torch.linalg.pinv(a[..., :3, :], rtol=0.2),
}


@pytest.mark.parametrize("matrix", [_SQUARE, _BATCH, _SYMMETRIC], ids=["square", "batch", "sym"])
@pytest.mark.parametrize("form", sorted(_PINVS))
def test_pinv_equals_torch(form: str, matrix: torch.Tensor) -> None:
    """The cut-off is torch's (``max(atol, rtol * largest)``; the forms with a tolerance drop
    one or more singular values of these matrices) and so is the gradient."""
    assert not _differences(_PINVS[form], [matrix])


def test_pinv_tolerance_per_matrix_of_a_batch() -> None:
    atol = torch.tensor([0.5, 1.5])  # (a batch field)
    assert not _differences(lambda a, t: torch.linalg.pinv(a, atol=t), [_BATCH], (atol,))


def test_pinv_with_a_float_tolerance_warns_of_nothing(recwarn: pytest.WarningsRecorder) -> None:
    """torch's ``pinv(a, atol=1.0)`` made its tolerance a float64 tensor, which JAX with x64
    off warned about on every trace."""
    assert not _differences(lambda a: torch.linalg.pinv(a, atol=1.0), [_SQUARE])
    assert not _differences(lambda a: torch.pinverse(a), [_SQUARE])
    assert not [w for w in recwarn if "float64" in str(w.message)]


def test_eigh_and_pinv_out_forms_write_their_results() -> None:
    class Out(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            w, v, p = torch.zeros(5), torch.zeros(5, 5), torch.zeros(5, 5)
            torch.linalg.eigh(a, UPLO="U", out=(w, v))
            torch.linalg.pinv(a, hermitian=True, out=p)
            return torch.cat([w, ((v * w**3) @ v.T).reshape(-1), p.reshape(-1)])

    def run(a: torch.Tensor) -> np.ndarray:
        fns = torch_model_fns(Out(), ("a",))
        return np.asarray(fns.apply({}, {}, {"a": a}, jax.random.key(0), True)[0])

    want = Out()(_SQUARE).numpy()
    np.testing.assert_allclose(run(jnp.asarray(_SQUARE.numpy())), want, rtol=1e-4, atol=1e-5)
