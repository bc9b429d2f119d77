"""JaxModule.from_lightning / from_torch on modules written the way public projects write
them, round 9 (tests/torchshell/wild9_modules.py): each trained in plain Lightning (or plain
torch) and through coreshell on the same loaders, losses per step and final weights
compared; what a compiled step cannot take is refused with coreshell's message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from jaxcore._errors import BatchError
from tests.torchshell import wild9_data as D
from tests.torchshell import wild9_modules as W
from tests.torchshell.port_helpers import agree
from tests.torchshell.test_port_wild3 import _pair, _trainer
from tests.torchshell.test_port_wild7 import _table
from tests.torchshell.test_port_wild8 import _torch_parity
from torchshell import JaxModule
from torchshell._errors import ConfigError, TorchModelError


def _close(runs: dict[str, tuple[L.Trainer, L.LightningModule]], *args: Any, **kw: Any) -> None:
    agree(runs, *args, **{"rtol": 1e-4, **kw})


def test_deepsurv_cox_partial_likelihood(tmp_path: Path) -> None:
    # the partial likelihood does not change with a constant shift of every risk: the output
    # bias's gradient is float noise, which Adam scales to the learning rate
    runs = _pair(W.DeepSurv, tmp_path, DataLoader(D.survival(64, 0), batch_size=16))
    _close(runs, skip=lambda name: 0 if name == "net.2.bias" else None)


def test_vae_on_torch_distributions_with_kl_annealing(tmp_path: Path) -> None:
    runs = _pair(W.DistributionsVAE, tmp_path, _table())
    series = {
        m: {k: np.asarray(runs[m][0].logger.series(k)) for k in ("kl", "beta", "z_mean", "recon")}
        for m in runs
    }
    jax, plain = series["jax"], series["plain"]
    np.testing.assert_allclose(jax["beta"], plain["beta"])  # global_step read every step
    np.testing.assert_allclose(jax["kl"][0], plain["kl"][0], rtol=1e-5)  # no noise yet
    assert len(set(jax["z_mean"])) == 8 and np.isfinite(jax["recon"]).all()
    np.testing.assert_allclose(jax["recon"].mean(), plain["recon"].mean(), rtol=0.2)


def _torch_then_ported(make: Any, loss: Any, loader: DataLoader, tmp_path: Path, **kw: Any) -> None:
    """``make()`` trained 2 epochs of SGD in plain torch and through from_torch (no forward
    before either: a BatchNorm's running statistics count every call): the same state."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = make()
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    net, opt = build()
    for _ in range(2):
        for *x, y in loader:
            opt.zero_grad()
            loss(net(*x), y).backward()
            opt.step()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    net, opt = build()
    _trainer(tmp_path).fit(JaxModule.from_torch(net, loss, opt, print_summary=False, **kw), loader)
    for name, value in want.items():
        torch.testing.assert_close(net.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_batchnorm_cumulative_average_groupnorm_rmsnorm(tmp_path: Path) -> None:
    # was: refused, "reads the buffer `net.bn.num_batches_tracked` as a Python number", a fix
    # in torch's own BatchNorm forward
    _close(_pair(W.LitNorms, tmp_path, _table(features=16)))
    _torch_then_ported(W.Norms, nn.CrossEntropyLoss(), _table(48, features=16), tmp_path / "t")


def test_missing_values_nan_in_the_batch(tmp_path: Path) -> None:
    _close(_pair(W.MissingValues, tmp_path, DataLoader(D.missing(64, 0), batch_size=16)))


def _task_loader(rows: D.TaskRows) -> DataLoader:
    return DataLoader(rows, batch_sampler=BatchSampler(SequentialSampler(rows), 16, False))


def test_module_dict_heads_picked_by_a_string_in_the_batch(tmp_path: Path) -> None:
    module = JaxModule.from_lightning(W.TaskHeads(), print_summary=False)
    with pytest.raises(BatchError, match=r"\['task'\] holds a list.*Fix: turn it into a tensor"):
        _trainer(tmp_path / "refused").fit(module, _task_loader(D.TaskRows(64, 0)))
    # the fix followed: the task as an id, the head's name looked up from it
    runs = _pair(lambda: W.TaskIdHeads(False), tmp_path, _task_loader(D.TaskIdRows(64, 0)))
    _close(runs)


class _PerTaskEveryEpoch(W.TaskIdHeads):
    """A loss per task logged on step and on epoch (``sentiment_loss_step``/``_epoch``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        task = D.TASKS[int(batch["task"][0])]
        loss = F.cross_entropy(self.heads[task](self.trunk(batch["x"])), batch["y"])
        self.log(f"{task}_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        task = D.TASKS[int(batch["task"][0])]
        loss = F.cross_entropy(self.heads[task](self.trunk(batch["x"])), batch["y"])
        self.log(f"val_{task}_loss", loss)


def test_a_log_name_per_task_read_from_the_batch(tmp_path: Path) -> None:
    # was: a raw KeyError in port/_user.py train_values (the step specialised on one task
    # logs that task's name only). As plain Lightning: a name keeps its last value on the
    # steps of the other task until the epoch ends, and callback_metrics end on the last
    # step's values (they were the last logging step's under log_every_n_steps=3)
    loader = _task_loader(D.TaskIdRows(64, 0))
    _close(_pair(W.TaskIdHeads, tmp_path / "each", loader), ("sentiment_loss", "topic_loss"))
    _close(_pair(W.TaskIdHeads, tmp_path / "third", loader, log_every_n_steps=3))
    runs = _pair(_PerTaskEveryEpoch, tmp_path / "epoch", loader, loader, log_every_n_steps=3)
    names = [f"{t}_loss_{s}" for t in D.TASKS for s in ("step", "epoch")]
    _close(runs, (*names, *(f"val_{t}_loss" for t in D.TASKS)))


def test_clip_learned_logit_scale(tmp_path: Path) -> None:
    _close(_pair(W.CLIP, tmp_path, DataLoader(D.pairs(64, 0), batch_size=16)), ("scale",))


def test_audio_conv1d_interpolate_adaptive_pools(tmp_path: Path) -> None:
    _torch_parity(W.AudioNet, nn.CrossEntropyLoss(), DataLoader(D.clips(48, 0), 16), tmp_path)


def test_llama_block_einsum_triu_rotary_swiglu(tmp_path: Path) -> None:
    _close(_pair(W.TinyLlama, tmp_path, DataLoader(D.tokens(64, 0), batch_size=16), max_epochs=1))


def test_a_full_backward_hook_is_refused_and_a_tensor_hook_does_the_same(tmp_path: Path) -> None:
    # was: the backward hook never ran in the traced step; training silently differed (the
    # loss 1.0695 against torch's 1.0863 at step 5)
    module = JaxModule.from_lightning(W.Hooked(), print_summary=False)
    with pytest.raises(TorchModelError, match=r"Linear module .* backward hook .*Fix: hook the"):
        _trainer(tmp_path / "refused").fit(module, _table())
    # the fix followed (a tensor hook in a forward pre-hook) trains as the backward hook does
    runs = {}
    for mode, tensor_hook in (("plain", False), ("jax", True)):
        torch.manual_seed(0)
        user = W.Hooked(tensor_hook)
        fit = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        trainer = _trainer(tmp_path / mode)
        trainer.fit(fit, _table())
        runs[mode] = (trainer, user)
    _close(runs)


class _HookedEval(W.Hooked):
    """:class:`Hooked` with a forward, a ``validation_step`` and a ``predict_step``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def test_a_full_backward_hook_runs_in_validate_and_predict_only_runs(tmp_path: Path) -> None:
    # was: refused as in training, though no backward runs (torch runs no backward hook)
    got, want = {}, {}
    for mode, out in (("plain", want), ("jax", got)):
        torch.manual_seed(0)
        user = _HookedEval()
        fit = user if mode == "plain" else JaxModule.from_lightning(user, print_summary=False)
        trainer = _trainer(tmp_path / mode)
        out["val"] = trainer.validate(fit, _table(), verbose=False)[0]["val_loss"]
        out["predict"] = torch.cat(trainer.predict(fit, _table())).numpy()
    np.testing.assert_allclose(got["val"], want["val"], rtol=1e-5)
    np.testing.assert_allclose(got["predict"], want["predict"], rtol=1e-5, atol=1e-6)
    # ... and a fit is still refused at its training step, after the sanity check's
    # validation steps ran
    module = JaxModule.from_lightning(_HookedEval(), print_summary=False)
    with pytest.raises(TorchModelError, match=r"Linear module .* backward hook .*Fix: hook the"):
        _trainer(tmp_path / "fit").fit(module, _table(), _table())


def test_configure_gradient_clipping_refused_and_skipping_the_rest_of_an_epoch(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"configure_gradient_clipping.*gradient_clip_val"):
        JaxModule.from_lightning(W.ClipsAfterFirstEpoch(), print_summary=False)
    runs = _pair(W.NoClipOverride, tmp_path, _table(96), gradient_clip_val=0.05)
    _close(runs)  # on_train_batch_start -> -1 at batch 3: three steps of six per epoch
    assert runs["jax"][0].global_step == runs["plain"][0].global_step == 6


def test_embedding_scale_grad_by_freq_is_refused_naming_the_fix(tmp_path: Path) -> None:
    net = W.MatrixFactorization()
    module = JaxModule.from_torch(
        net,
        nn.MSELoss(),
        torch.optim.SGD(net.parameters(), lr=0.1),
        inputs=(0, 1),
        print_summary=False,
    )
    with pytest.raises(TorchModelError, match=r"scale_grad_by_freq=True.*Fix: set it to False"):
        _trainer(tmp_path, max_epochs=1).fit(module, DataLoader(D.ratings(32, 0), batch_size=16))


def test_adaptive_log_softmax_with_loss(tmp_path: Path) -> None:
    # was: refused, "the op `aten::nonzero` ... reads the value of one of its arguments", a
    # fix in torch's adaptive.py
    _close(
        _pair(
            W.AdaptiveSoftmaxLM, tmp_path, DataLoader(D.tokens(64, 0), batch_size=16), max_epochs=1
        )
    )


def test_sparse_embedding_tables_under_sgd(tmp_path: Path) -> None:
    loader = DataLoader(D.ratings(48, 0), batch_size=16)
    _torch_then_ported(W.SparseFactorization, nn.MSELoss(), loader, tmp_path, inputs=(0, 1))


def test_adaptive_log_softmax_target_past_n_classes_refused_as_torch_refuses(
    tmp_path: Path,
) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 16, (32,), generator=g)
    y[5] = 17
    loader = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    with pytest.raises(RuntimeError, match=r"Target values should be in \[0, 15\]"):
        _trainer(tmp_path / "plain").fit(W.AdaptiveHead(), loader)
    module = JaxModule.from_lightning(W.AdaptiveHead(), print_summary=False)
    with pytest.raises(BatchError, match=r"target 17 .*\[0, 15\]. Fix: map the targets"):
        _trainer(tmp_path / "jax").fit(module, loader)
