"""torch's own op database (``op_db``) through the trace: a fixed, representative share.

Each op's first two samples with non-empty tensors run through the trace as
:mod:`tests.torchshell.opinfo_harness` runs them (values and gradients against torch eager,
float32, rtol 1e-4, atol 1e-5): each must be equal, or refused with coreshell's message
(``TorchModelError``), or, for an op that draws, vary with the step's key. Never silently
different (issue #52; docs/torch_model.md). The ops include each one the whole database once
found silently different; the whole database is ``make opinfo``
(``tests/torchshell/opinfo_sweep.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.opinfo.core import SampleInput

from tests.torchshell.opinfo_harness import PASSING, compare, draws, in_scope, samples
from tests.torchshell.opinfo_sweep import DOC
from tests.torchshell.opinfo_table import block, parse, render

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
    ("cholesky", ""),  # (torch's symmetric gradient: trace/_cholesky.py)
    ("linalg.cholesky", ""),
    ("cholesky_solve", ""),  # (the factor's gradient over the whole matrix)
    ("nn.functional.max_unpool2d", ""),  # (repeated indices: each input gets its gradient)
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


@pytest.mark.filterwarnings("ignore")  # (torch's samples and JAX's x64-off casts warn)
def test_op_database_share_is_never_silently_different() -> None:
    by_name = {(op.name, op.variant_test_name): op for op in op_db}
    missing = [key for key in OPS if key not in by_name]
    assert not missing, f"not in this torch's op_db: {missing}"
    wrong = []
    for key in OPS:
        op = by_name[key]
        for k, sample in enumerate(samples(op)):
            found = compare(op, sample, random=draws(op))
            if found.kind not in PASSING:
                wrong.append(f"{'.'.join(filter(None, key))} sample {k}: {found}")
    assert not wrong, "silently different from torch:\n" + "\n".join(wrong)


def test_op_table_in_the_docs_is_the_sweeps_and_lists_every_op() -> None:
    """docs/torch_model.md's op table is in the sweep's format (rendering its own rows gives
    it back, totals included) and lists every op of this torch's ``op_db``, swept where the
    op supports float32 autograd on CPU: a torch upgrade that adds ops shows here."""
    generated = block(DOC.read_text())
    rows, version = parse(generated)
    assert render(rows, version) == generated, (
        "docs/torch_model.md's op table is not in the format of tests/torchshell/"
        "opinfo_table.py: regenerate it with `make opinfo`"
    )
    listed = [r.key for r in rows]
    assert len(set(listed)) == len(listed), "an op is listed twice"
    scope = {(op.name, op.variant_test_name): in_scope(op) for op in op_db}
    fix = f"run `make opinfo` under this torch ({torch.__version__}) and commit the table"
    assert version == torch.__version__.split("+")[0], f"the table is of torch {version}: {fix}"
    missing, extra = sorted(scope.keys() - set(listed)), sorted(set(listed) - scope.keys())
    assert not missing, f"not in the table: {missing[:10]} ({len(missing)}): {fix}"
    assert not extra, f"no longer in op_db: {extra[:10]} ({len(extra)}): {fix}"
    unswept = [r.key for r in rows if (r.status == "not swept") == scope[r.key]]
    assert not unswept, f"swept or not, not as op_db says now: {unswept[:10]}: {fix}"


@pytest.mark.filterwarnings("ignore")  # (as above)
def test_ctc_loss_of_raw_scores_has_torchs_gradient() -> None:
    """torch's CTC kernel gives ``exp(input) - posterior``, not the derivative of its loss: a
    head that feeds raw scores (no ``log_softmax``) trains in torch as if they were
    normalised. The trace gave JAX's derivative, ~1e-4 off per element (op_db's
    ``nn.functional.ctc_loss`` samples, silently); now torch's (trace/_ctc_grad.py)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(12, 3, 5, generator=g, requires_grad=True)  # [T, N, C], raw
    targets = torch.tensor([[1, 2, 2], [3, 1, 0], [4, 4, 4]])
    sample = SampleInput(scores, args=(targets, torch.tensor([12, 9, 11]), torch.tensor([3, 2, 3])))
    found = compare(SimpleNamespace(op=F.ctc_loss), sample)
    assert found.kind in ("equal", "noise"), found
