"""Fixes that work, for the ops the trace refuses on purpose (issue #52).

The generic refusals ("replace that layer with an equivalent made of supported ops", "call
it with other arguments") named no rewrite; for the ops torch's op database found refused
each fix here is a rewrite that traces and gives torch's values
(``tests/torchshell/test_silent_ops_refused.py`` follows each one).
"""

from __future__ import annotations

_FIXES = {
    "linalg_eig": (
        "a general (non-symmetric) matrix's eigenvectors have no gradient JAX can compute "
        "without assumptions it cannot check, and JAX has no TPU eig. Fix: for a symmetric "
        "(Hermitian) matrix call torch.linalg.eigh / torch.linalg.eigvalsh (lowered, torch's "
        "values and gradients), or compute the decomposition outside the step (a buffer), "
    ),
    "fractional_max_pool2d": (
        "torch draws its pooling windows at random per sample (its own sampler, no JAX "
        "lowering). Fix: pool with fixed windows instead: F.adaptive_max_pool2d(x, "
        "output_size) (windows evenly spread, no random draw), "
    ),
    "fractional_max_pool3d": (
        "torch draws its pooling windows at random per sample (its own sampler, no JAX "
        "lowering). Fix: pool with fixed windows instead: F.adaptive_max_pool3d(x, "
        "output_size) (windows evenly spread, no random draw), "
    ),
    "_to_sparse": (
        "a traced JAX step has no torch sparse tensors. Fix: keep the tensor dense (drop "
        ".to_sparse(); torch.sparse.mm(a, b) of dense tensors is a @ b), "
    ),
}
_COMPLEX32 = (
    "JAX has no complex32 (x.chalf(), torch.complex32). Fix: use complex64 "
    "(x.to(torch.complex64), x.cfloat()), "
)


def op_fix(op: str, err: BaseException) -> str | None:
    """The fix for a refused ``op`` (its reason first, up to the Flax route), if known."""
    if "complex32" in str(err):
        return _COMPLEX32
    return _FIXES.get(op.split("::")[-1].split(".")[0])
