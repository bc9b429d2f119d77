"""JaxModule.from_lightning / from_torch on code written the way public projects write it
(round 7, tests/torchshell/wild7_modules.py): DANN's gradient reversal and a straight-through
quantizer (``torch.autograd.Function`` backwards), ``Tensor.register_hook``, a streaming
``IterableDataset``, numpy float64 rows, ESPCN, TorchScript, forward hooks,
``Embedding(max_norm=)``, siamese and Gaussian losses, a padded transformer with a namedtuple
collate and transformers' cosine schedule, Gumbel-softmax, ``torch.distributions``, a spatial
transformer, an orthogonal RNN, ``overfit_batches``, grad-mode regions and gradient penalties.
Each runs in plain Lightning (or torch) and through coreshell on the same loaders: losses per
step and final weights agree, or the pattern is refused with the cause and the fix, as torch
refuses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.torchshell import wild7_modules as W
from tests.torchshell.port_helpers import agree
from tests.torchshell.test_port_wild3 import _pair, _trainer
from torchshell import JaxModule
from torchshell._errors import TorchModelError


def _table(n: int = 64, seed: int = 0, features: int = 8, **kwargs: Any) -> DataLoader:
    """Four batches of 16."""
    return DataLoader(W.table(n, seed, features), batch_size=16, **kwargs)


def _close(runs: dict[str, tuple[L.Trainer, L.LightningModule]], *args: Any, **kw: Any) -> None:
    """:func:`agree` at ``rtol=1e-4`` unless given."""
    agree(runs, *args, **{"rtol": 1e-4, **kw})


def test_dann_gradient_reversal_function_keeps_its_backward(tmp_path: Path) -> None:
    # the Function's backward (-alpha * grad) never ran: JAX differentiated its identity
    # forward, so the features trained *with* the domain classifier (loss 7e-3 apart by step 3)
    runs = _pair(W.DANN, tmp_path, DataLoader(W.domains(64, 0), batch_size=16))
    _close(runs, ("train_loss", "class_loss", "domain_loss"))


def test_from_torch_straight_through_quantizer_with_setup_context(tmp_path: Path) -> None:
    # round() has a zero gradient in JAX: fc1 never trained (the STE's backward passes it)
    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        net = W.QuantNet()
        return net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)

    net, opt = build()
    for _ in range(2):
        for x, y in _table():
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    want = net.state_dict()
    net, opt = build()
    before = net.fc1.weight.detach().clone()
    module = JaxModule.from_torch(net, nn.CrossEntropyLoss(), opt, print_summary=False)
    _trainer(tmp_path).fit(module, _table())
    got = module.torch_state_dict()
    assert not torch.allclose(got["fc1.weight"], before)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_gradient_hook_registered_on_an_activation(tmp_path: Path) -> None:
    # was: torch's "cannot register a hook on a tensor that doesn't require gradient", raw
    _close(_pair(W.GradHookScale, tmp_path, _table()))


def test_a_streaming_iterable_dataset_without_len_and_max_steps(tmp_path: Path) -> None:
    # 36 rows in batches of 8: a ragged fifth batch, and max_steps crossing into epoch 2
    loader = DataLoader(W.Stream(36, 0), batch_size=8)
    runs = _pair(W.StreamRegressor, tmp_path, loader, max_steps=7, max_epochs=-1)
    _close(runs)
    assert runs["jax"][0].global_step == runs["plain"][0].global_step == 7
    assert len(runs["jax"][0].logger.series("train_loss")) == 7


def test_numpy_float64_rows_cast_with_float_in_the_step(tmp_path: Path) -> None:
    loader = DataLoader(W.NumpyRows(48, 0), batch_size=16)
    assert next(iter(loader))[0].dtype == next(iter(loader))[1].dtype == torch.float64
    _close(_pair(W.NumpyRegressor, tmp_path, loader))


def test_a_float64_field_into_a_float32_layer_is_refused_as_torch_refuses(
    tmp_path: Path,
) -> None:
    # torch: "mat1 and mat2 must have the same dtype, but got Double and Float"; the field
    # reached JAX as float32 (x64 off) and trained, silently
    loader = DataLoader(W.NumpyRows(48, 0), batch_size=16)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        _trainer(tmp_path / "plain").fit(W.NumpyRegressorUncast(), loader)
    module = JaxModule.from_lightning(W.NumpyRegressorUncast(), print_summary=False)
    match = r"input float64, weight float32.*Double and Float.*Fix: cast the batch field"
    with pytest.raises(TorchModelError, match=match):
        _trainer(tmp_path / "jax").fit(module, loader)


def test_a_double_module_trains_in_float32_and_says_so(tmp_path: Path) -> None:
    # was silent: float64 weights and batch narrowed to float32 with no word
    with pytest.warns(RuntimeWarning, match=r"float64 weights.*computes them in float32"):
        runs = _pair(W.DoubleRegressor, tmp_path, DataLoader(W.NumpyRows(48, 0), batch_size=16))
    _close(runs)
    assert runs["jax"][1].net[0].weight.dtype == torch.float64


def test_espcn_prelu_instance_norm_pixel_shuffle(tmp_path: Path) -> None:
    loaders = DataLoader(W.images(32, 0), batch_size=8), DataLoader(W.images(16, 1), batch_size=8)
    runs = _pair(W.ESPCN, tmp_path, *loaders, max_epochs=1)
    # (the conv bias before InstanceNorm has a zero gradient: Adam moves it by float noise)
    _close(
        runs,
        ("train_loss", "psnr", "val_l1"),
        skip=lambda n: slice(None) if n == "body.0.bias" else None,
    )


def test_torchscript_function_and_an_ignored_method(tmp_path: Path) -> None:
    _close(_pair(W.ScriptedMLP, tmp_path, _table()), ("train_loss", "act"))


def test_deep_supervision_through_forward_hooks(tmp_path: Path) -> None:
    _close(_pair(W.HookedSupervision, tmp_path, _table()))


def test_embedding_max_norm_is_refused_naming_it_and_the_fix(tmp_path: Path) -> None:
    # was: "... reads the value of one of its arguments in Python ... a constant tensor
    # passed where a number is read" (torchax's embedding_renorm_), no word of max_norm
    torch.manual_seed(0)
    module = JaxModule.from_lightning(W.MaxNormBag(), print_summary=False)
    loader = DataLoader(W.Sentences(16, 0), batch_size=8, collate_fn=W.pad_collate)
    match = r"nn.Embedding\(max_norm=1\) .*module emb.*in place.*Fix: drop max_norm.*renorm_"
    with pytest.raises(TorchModelError, match=match):
        _trainer(tmp_path).fit(module, loader)


@pytest.mark.parametrize(
    ("make", "data", "series"),
    [
        (W.Siamese, W.pairs, ("cosine", "ranking")),
        (W.GaussianHead, W.regression, ("train_loss",)),
    ],
    ids=["cosine_embedding_margin_ranking", "gaussian_nll_huber"],
)
def test_siamese_and_probabilistic_regression_losses(
    tmp_path: Path, make: Any, data: Any, series: tuple[str, ...]
) -> None:
    _close(_pair(make, tmp_path, DataLoader(data(64, 0), batch_size=16)), series)


@pytest.mark.filterwarnings("ignore:You requested to overfit but enabled train dataloader")
def test_overfit_batches_with_a_shuffled_loader(tmp_path: Path) -> None:
    loader = DataLoader(W.pairs(64, 0), batch_size=16, shuffle=True)
    runs = _pair(W.Siamese, tmp_path, loader, overfit_batches=2)
    _close(runs, ("cosine", "ranking"))
    assert runs["jax"][0].global_step == runs["plain"][0].global_step == 4


def test_padded_transformer_namedtuple_collate_tied_weights_cosine_warmup(
    tmp_path: Path,
) -> None:
    loaders = (DataLoader(W.Sentences(32, 0), batch_size=8, collate_fn=W.pad_collate),)
    loaders += (DataLoader(W.Sentences(16, 1), batch_size=8, collate_fn=W.pad_collate),)
    runs = _pair(W.PaddedTransformer, tmp_path, *loaders, max_epochs=1)

    def key_bias(name: str) -> Any:  # (its exact gradient is zero: Adam's float noise)
        return slice(16, 32) if name.endswith("in_proj_bias") else None

    _close(runs, ("train_loss", "val_acc"), rtol=1e-3, skip=key_bias)
    assert "pos.pe" not in runs["jax"][1].state_dict()


def test_gumbel_softmax_draws_its_noise_anew_every_step(tmp_path: Path) -> None:
    # torchax drew exponential_ from one fixed key: the same noise every step, and a NaN
    # loss at step 0 here (NonFiniteError), where torch trains
    runs = _pair(W.GumbelCodes, tmp_path, _table())
    losses = {m: np.asarray(runs[m][0].logger.series("train_loss")) for m in runs}
    assert np.isfinite(losses["jax"]).all() and len(losses["jax"]) == 8
    np.testing.assert_allclose(losses["jax"].mean(), losses["plain"].mean(), rtol=0.3)
    noise = runs["jax"][0].logger.series("noise_mean")
    assert len(set(noise)) == len(noise) and all(0.9 < v < 1.1 for v in noise)


def test_actor_critic_on_torch_distributions(tmp_path: Path) -> None:
    # Categorical/Normal check their arguments (`if not valid.all(): raise ValueError`):
    # the check's failing path was traced last, and its records (none) were kept: a raw
    # IndexError (host reads) or "zip() argument 2 is longer than argument 1" (self.log)
    runs = _pair(W.ActorCritic, tmp_path, DataLoader(W.rollouts(64, 0), batch_size=16))
    _close(runs, ("train_loss", "kl"), ignore=("sampled_action",))
    sampled = runs["jax"][0].logger.series("sampled_action")
    assert len(sampled) == 8 and all(0 <= v <= 2 for v in sampled)


@pytest.mark.parametrize(
    ("make", "features"),
    [(W.SpatialTransformer, 64), (W.OrthogonalRNN, 8)],
    ids=["affine_grid_grid_sample", "orthogonal_parametrization"],
)
def test_spatial_transformer_and_an_orthogonal_rnn(
    tmp_path: Path, make: Any, features: int
) -> None:
    _close(_pair(make, tmp_path, _table(features=features), max_epochs=1))


def test_a_frozen_encoder_under_set_grad_enabled_and_inference_mode(tmp_path: Path) -> None:
    # set_grad_enabled(False) was not a no-grad region in the step: the encoder trained;
    # inference_mode() stopped the trace at aten::dropout ("torchax cannot lower the op")
    runs = _pair(W.FineTuner, tmp_path, _table())
    _close(runs, ("train_loss", "train_acc"))
    user = runs["jax"][1]
    torch.manual_seed(0)
    assert torch.equal(user.encoder[0].weight, W.FineTuner().encoder[0].weight)


def test_a_gradient_penalty_with_torch_func_and_autograd_grad_refused(tmp_path: Path) -> None:
    # torch.func.vjp/grad: jax.vjp of the function, differentiated again by the step;
    # torch.autograd.grad was torch's raw "element 0 of tensors does not require grad and
    # does not have a grad_fn" (and torch.func stopped on "a plain CPU torch.Tensor")
    _close(_pair(W.CriticGPFunc, tmp_path, _table()), ("train_loss", "gp"))
    module = JaxModule.from_lightning(W.CriticGP(), print_summary=False)
    with pytest.raises(TorchModelError, match=r"torch.autograd.grad.*Fix:.*torch.func.vjp"):
        _trainer(tmp_path / "autograd").fit(module, _table())
