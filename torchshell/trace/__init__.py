"""The torchax tracing of :mod:`torchshell.torch_model`, and the PyTorch patterns it traces.

Real torch code reads tensor values in Python. Under ``jax.jit`` every value is a tracer, so
torchax alone stops there. The environment here traces four such patterns instead:

- **values that do not depend on the batch** (masks built from shapes,
  ``generate_square_subsequent_mask``, ``torch.equal`` of two such masks in
  ``nn.TransformerDecoder``'s ``_detect_is_causal_mask``, pad amounts computed from constant
  buffers) are computed while tracing (:mod:`._fold`), so Python sees concrete values;
- **eval-mode fast paths** torchax cannot lower (the nested-tensor path of
  ``nn.TransformerEncoder`` with a padding mask, the fused MHA kernel) are switched off while
  tracing (:func:`tracing`), so torch takes its math path;
- **a traced value used as a Python bool** (layer drop: ``torch.rand(1).item() <= p``)
  becomes a ``lax.cond`` on that value (:func:`explore`);
- **a scalar read from the batch** (``int(lengths.max().item())``) is *specialised*
  (:class:`Reads`, :mod:`._static`).

Ops torchax lacks or gets wrong are lowered here too (:mod:`._lowerings`, :mod:`._kinks` for
torch's gradient of ``clamp``/``hardtanh``/``relu6``/``abs``... on a bound, :mod:`._norms` for
its gradient of norms, distances and ``std`` at a zero vector (0, not NaN), :mod:`._rnnt` for
torchaudio's RNN-T loss, :mod:`._ctc` for the CTC loss, and :mod:`._attention`:
``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` as one fused
``jax.nn.dot_product_attention`` call), and an in-place op on a slice writes through to the
sliced tensor (:mod:`._inplace`: ``bias[C:2*C].zero_()``).
"""

from torchshell.trace._env import environment, tracing
from torchshell.trace._float64 import weight_as_jax
from torchshell.trace._paths import (
    Bound,
    attributes_kept,
    decode,
    encode,
    explore,
    is_check,
    mode,
    plain,
    spec,
    traced,
)
from torchshell.trace._reads import (
    HOST,
    TRACED,
    Branch,
    NeedsStatic,
    ProbeDone,
    Reads,
    TracedScalar,
)
from torchshell.trace._targets import check_class_target
from torchshell.trace._torchax import install as _install_torchax_hook

_install_torchax_hook()  # torchax imports under a torch lacking an overload it names

__all__ = [
    "HOST",
    "TRACED",
    "Bound",
    "Branch",
    "NeedsStatic",
    "ProbeDone",
    "Reads",
    "TracedScalar",
    "attributes_kept",
    "check_class_target",
    "decode",
    "encode",
    "environment",
    "explore",
    "is_check",
    "mode",
    "plain",
    "spec",
    "traced",
    "tracing",
    "weight_as_jax",
]
