"""Tracing a torch forward (torchshell/trace/): values from constants stay concrete, and every
failure of a trace is coreshell's error naming the op, the module, the line and the fix.

Each test runs a real module through ``torch_model_fns`` and checks the outcome against torch
itself (or the message a user gets).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from tests.zoo.harness import sgd_parity
from torchshell._errors import TorchModelError
from torchshell.torch_model import torch_model_fns


class _BufferPads(nn.Module):
    """transformers' ``EncodecConv1d``, reduced: pad amounts computed from constant,
    non-persistent int64 buffers, then ``F.pad`` and a strided convolution."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.conv, self.mode = nn.Conv1d(2, 3, 4, stride=2), mode
        stride, kernel = torch.tensor(2), torch.tensor(4)
        self.stride = nn.Buffer(stride, persistent=False)
        self.kernel_size = nn.Buffer(kernel, persistent=False)
        self.padding_total = nn.Buffer(kernel - stride, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = (length - self.kernel_size + self.padding_total) / self.stride + 1
        frames = torch.ceil(frames).to(torch.int64) - 1
        extra = frames * self.stride + self.kernel_size - self.padding_total - length
        right = self.padding_total // 2
        left = self.padding_total - right
        return self.conv(nn.functional.pad(x, (left, right + extra), self.mode)).flatten(1)


@pytest.mark.parametrize("mode", ["reflect", "constant"])
def test_pad_amounts_from_constant_buffers_trace_and_match_torch_sgd(mode: str) -> None:
    """Before: ``TorchModelError ... needs a tensor's value in Python (TracerBoolConversionError:
    a number computed from the weights or a random draw ...)``: torchax's ``F.pad`` compared
    the buffer-derived amounts (``if pad_start < 0``) inside an op with a traced input."""
    torch.manual_seed(0)
    net = _BufferPads(mode)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 2, 11, generator=g)} for _ in range(3)]
    out = net(batches[0]["x"]).shape[1]
    batches = [{**b, "y": torch.randn(4, out, generator=g)} for b in batches]
    p = sgd_parity(net, batches, ("x",), "l2")
    assert p.max_rel <= 1e-5, p
    np.testing.assert_allclose(p.jax_losses, p.torch_losses, rtol=1e-5)


def test_a_tiny_encodec_traces_and_matches_torch() -> None:
    """transformers' EncodecModel (randomly initialised, tiny): encoder, quantizer, decoder."""
    transformers = pytest.importorskip("transformers")
    config = transformers.EncodecConfig(
        hidden_size=16,
        num_filters=4,
        upsampling_ratios=[2, 2],
        codebook_size=16,
        codebook_dim=16,
        num_lstm_layers=1,
        target_bandwidths=[1.5],
        sampling_rate=800,
    )
    torch.manual_seed(0)
    model = transformers.EncodecModel(config).eval()

    class Codec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, audio: torch.Tensor) -> torch.Tensor:
            return self.model(audio).audio_values

    net = Codec()
    audio = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = net(audio).numpy()
    fns = torch_model_fns(net, ("audio",), example={"audio": audio})
    batch = {"audio": jnp.asarray(audio.numpy())}
    params, state = fns.init(jax.random.key(0), batch)
    for train in (False, True):
        apply = jax.jit(lambda p, s, b, t=train: fns.apply(p, s, b, jax.random.key(0), t)[0])
        got = np.asarray(apply(params, state, batch))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_a_pad_amount_from_the_weights_is_named_as_what_it_is() -> None:
    """A pad amount that really is traced: the message names the op, its lowering's line and
    what is traced, not a generic "needs a tensor's value"."""

    class FromWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            extra = (self.lin.weight.sum() > 0).long()
            return nn.functional.pad(self.lin(x), (0, extra))

    with pytest.raises(TorchModelError) as err:
        torch_model_fns(FromWeights(), example={"x": torch.ones(2, 6)})
    msg = str(err.value)
    assert "lowering of the op `pad`" in msg and "jtorch.py:" in msg, msg
    assert "<root> (FromWeights)" in msg and "test_trace.py:" in msg, msg
    assert "a tensor argument there is traced" in msg and "Fix:" in msg, msg


# -- no raw torchax or JAX exception reaches the user ------------------------------------------
@torch.library.custom_op("coreshell_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    """A custom op with its own C++ (CPU) kernel and no JAX lowering."""
    return x * 2


def test_an_op_without_a_lowering_is_named_not_torchax_assertion() -> None:
    """Before: the raw ``AssertionError: torchax Tensors can only do math within the torchax
    environment...`` (a custom op, e.g. torchaudio's ``rnnt_loss`` before it was lowered, runs
    its own kernel on torchax tensors)."""

    class Transducer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.joint = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _doubled(self.joint(x)).sum()

    with pytest.raises(TorchModelError) as err:
        torch_model_fns(Transducer(), ("x",), example={"x": torch.randn(2, 4)})
    msg = str(err.value)
    assert "no lowering for the op `coreshell_test::doubled`" in msg, msg
    assert "<root> (Transducer)" in msg and "test_trace.py:" in msg and "Fix:" in msg, msg
    assert isinstance(err.value.__cause__, AssertionError)  # kept as the cause, not shown raw


def test_branches_of_a_traced_bool_that_disagree_are_named_not_jax_type_error() -> None:
    """Before: JAX's raw ``TypeError: cond branches must have equal output types``."""

    class Crop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y[:, :2] if torch.rand(1).item() < 0.5 else y

    with pytest.raises(TorchModelError) as err:
        torch_model_fns(Crop(), example={"x": torch.ones(2, 4)})
    msg = str(err.value)
    assert "traced Python bool" in msg and "torch.where" in msg and "Fix:" in msg, msg
    assert isinstance(err.value.__cause__, TypeError)
