"""JaxModule.from_lightning on LightningModules written the way public projects write them
(tests/torchshell/wild3_modules.py): each trained in plain Lightning and through the port on
the same loaders, losses per step and final weights compared; the patterns a compiled step
cannot take are refused with coreshell's own message."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.torchshell import wild3_modules as W
from tests.torchshell.port_helpers import agree
from tests.torchshell.test_port import Recorder
from torchshell import JaxModule
from torchshell._errors import ConfigError, TorchModelError


def _trainer(root: Path, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=Recorder(),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=root,
    )
    return L.Trainer(**(options | kwargs))


def _pair(
    make: Callable[[], L.LightningModule],
    tmp_path: Path,
    *loaders: Any,
    callbacks: Callable[[], list[Any]] = list,
    **flags: Any,
) -> dict[str, tuple[L.Trainer, L.LightningModule]]:
    """``make()`` fit in plain Lightning and through from_lightning (same seed, same loaders):
    ``{"plain"|"jax": (trainer, the user's module, trained)}``."""
    runs = {}
    for mode in ("plain", "jax"):
        torch.manual_seed(0)
        user = make()
        module = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        trainer = _trainer(tmp_path / mode, callbacks=callbacks(), **flags)
        trainer.fit(module, *loaders)
        runs[mode] = (trainer, user)
    return runs


def _table(n: int = 64, seed: int = 0, batch: int = 16) -> DataLoader:
    """Four batches of 16 (no ragged last batch: one compiled step less to wait for)."""
    return DataLoader(W.table(n, seed), batch_size=batch)


def _encoded(n: int, seed: int) -> DataLoader:
    return DataLoader(W.Encoded(n, seed), batch_size=8)


def test_torchmetrics_objects_log_dict_and_warm_restarts(tmp_path: Path) -> None:
    # MulticlassAccuracy in training_step logged through log_dict, update()+log(metric) and a
    # logged F1 in validation_step, ([Adam], [CosineAnnealingWarmRestarts]) per epoch
    runs = _pair(W.MetricsClassifier, tmp_path, _table(), _table(30, 1))
    agree(runs, ("train_loss_step", "train_acc_step", "train_acc_epoch", "val_acc", "val_f1"), 1e-4)


def test_autoencoder_returning_a_dict_to_callbacks(tmp_path: Path) -> None:
    seen: list[W.ReconSeen] = []

    def callbacks() -> list[Any]:
        seen.append(W.ReconSeen())
        return [seen[-1]]

    runs = _pair(W.AutoEncoder, tmp_path, _table(70), _table(30, 1), callbacks=callbacks)
    agree(runs, ("train_loss_step", "train_loss_epoch", "val_mse"))
    plain, ours = seen
    assert (
        [s for s, _, _ in ours.seen]
        == [s for s, _, _ in plain.seen]
        == [(16, 8)] * 4 + [(6, 8)] + [(16, 8)] * 4 + [(6, 8)]
    )
    np.testing.assert_allclose([m for _, m, _ in ours.seen], [m for _, m, _ in plain.seen], 1e-5)


def test_validation_outputs_gathered_with_trainer_reads_and_self_print(tmp_path: Path) -> None:
    # validation_step_outputs aggregated with torch.cat and one_hot at the epoch end,
    # self.trainer.is_global_zero, self.current_epoch weighting the loss, self.print
    runs = _pair(W.GatheredValidation, tmp_path, _table(), _table(30, 1))
    agree(runs, ("train_loss", "val_acc", "val_loss", "val_pred_class0"))
    assert runs["jax"][1].printed == runs["plain"][1].printed


@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no")
def test_text_transformer_with_no_decay_groups_and_warmup(tmp_path: Path) -> None:
    # dict batches, a key padding mask, masked mean pooling, AdamW's no_decay groups, a
    # transformers-style linear warmup LambdaLR over estimated_stepping_batches
    runs = _pair(W.TextClassifier, tmp_path, _encoded(40, 0), max_steps=6)

    # the key projection's bias has no gradient in exact math (softmax is shift-invariant):
    # Adam normalises float noise there, in torch as in JAX; it is left out (rows 16..31)
    def key_bias(name: str) -> Any:
        return slice(16, 32) if name.endswith("in_proj_bias") else None

    agree(runs, ("train_loss",), rtol=1e-4, skip=key_bias)


def test_frozen_backbone_stays_frozen(tmp_path: Path) -> None:
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in W.FrozenBackbone().backbone.state_dict().items()}
    runs = _pair(W.FrozenBackbone, tmp_path, _table())
    agree(runs, rtol=1e-4)
    for name, value in runs["jax"][1].backbone.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_tied_embedding_gru_language_model(tmp_path: Path) -> None:
    runs = _pair(W.TiedLM, tmp_path, DataLoader(W.Sentences(40, 0), batch_size=8), max_steps=4)
    agree(runs, ("train_loss", "train_ppl"), rtol=1e-4)
    user = runs["jax"][1]
    assert user.decoder.weight is user.encoder.weight


def test_buffers_updated_in_training_step(tmp_path: Path) -> None:
    runs = _pair(W.RunningNorm, tmp_path, _table())
    agree(runs)
    assert int(runs["jax"][1].seen) == int(runs["plain"][1].seen) == 128


def test_injected_network_metric_collection_chained_scheduler(tmp_path: Path) -> None:
    def make() -> L.LightningModule:
        return W.Injected(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))

    runs = _pair(make, tmp_path, _table(), _table(30, 1))
    agree(runs, ("train_loss", "train_acc", "train_prec", "val_acc", "val_prec"))


def test_vae_draws_fresh_noise_every_step(tmp_path: Path) -> None:
    # torch.randn_like in training_step: not torch's stream, but a new draw every step
    runs = _pair(W.VAE, tmp_path, _table())
    eps = runs["jax"][0].logger.series("eps_mean")
    assert len(eps) == 8 and len(set(eps)) == 8 and np.all(np.isfinite(eps))
    # the noise is a small part of the loss: the run stays near plain Lightning's
    recon, want = (runs[m][0].logger.series("recon") for m in ("jax", "plain"))
    np.testing.assert_allclose(np.mean(recon), np.mean(want), rtol=0.1)
    assert np.all(np.isfinite(runs["jax"][0].logger.series("kld")))


def test_optimizer_over_trainer_model_parameters(tmp_path: Path) -> None:
    # torch.optim.Adam(self.trainer.model.parameters()): the Trainer's model is the user's
    # module inside configure_optimizers, as in plain Lightning (it was the JaxModule: "optimizer
    # got an empty parameter list")
    agree(_pair(W.TrainerModelParams, tmp_path, _table()), rtol=1e-4)


def test_configure_model_and_a_lazy_layer_sized_by_example_input(tmp_path: Path) -> None:
    # configure_model builds the body, LazyLinear takes its shape from example_input_array
    # (with Lightning's default model summary, plain Lightning sizes it at the same point)
    agree(_pair(W.BuiltInSetup, tmp_path, _table(), enable_model_summary=True))


def test_a_head_built_in_setup_is_traced_and_trained(tmp_path: Path) -> None:
    # setup(stage) sizes the head from the data after from_lightning snapshotted the weights
    # (it was refused as "a plain CPU torch.Tensor mixed with the traced ones")
    runs = _pair(W.BuiltInSetupHook, tmp_path, _table())
    agree(runs)
    assert runs["jax"][1].head.weight.shape == (3, 16)


def test_a_backbone_frozen_in_on_train_start_stays_frozen(tmp_path: Path) -> None:
    # frozen after the optimizer was mapped, before the first step: traced and mapped anew
    # (the compiled step kept training the backbone it had traced as trainable)
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in W.FreezesOnTrainStart().backbone.state_dict().items()}
    runs = _pair(W.FreezesOnTrainStart, tmp_path, _table())
    agree(runs, rtol=1e-4)
    for name, value in runs["jax"][1].backbone.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_patterns_a_compiled_step_cannot_take_are_refused_with_the_fix(tmp_path: Path) -> None:
    cases = [
        (
            W.SkipsNonFinite,
            TorchModelError,
            r"SkipsNonFinite.training_step returned None on a path chosen by a traced value.*"
            r"nan_policy='skip'",
        ),
        (
            W.LazyNoExample,
            ConfigError,
            r"LazyNoExample has lazy parameters not sized yet \(net.0.weight, net.0.bias.*"
            r"example_input_array",
        ),
        (W.ActiveTokens, TorchModelError, r"boolean mask that is traced.*Fix: use masks"),
        (  # trained as before by the compiled step: refused at the epoch it changed
            W.UnfreezesLater,
            ConfigError,
            r"UnfreezesLater: backbone.0.weight, backbone.0.bias unfrozen \(requires_grad "
            r"changed\) before epoch 1.*separate fits",
        ),
    ]
    for make, error, match in cases:
        loader = _encoded(16, 0) if make is W.ActiveTokens else _table(32)
        torch.manual_seed(0)
        with pytest.raises(error, match=match):
            trainer = _trainer(tmp_path / make.__name__, max_epochs=2)
            trainer.fit(JaxModule.from_lightning(make(), print_summary=False), loader)
