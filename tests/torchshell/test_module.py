import jax
import numpy as np
import pytest

import jaxcore
from jaxcore.models.digits import MLP
from tests.helpers import quiet_trainer
from torchshell import JaxModule
from torchshell.data.digits import DigitsDataModule


def test_jax_module_trains_digits_under_real_trainer():
    module = JaxModule(
        MLP(features=(64,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        mesh=jaxcore.make_mesh({"data": -1, "model": 1}),
    )
    trainer = quiet_trainer(max_steps=150)
    dm = DigitsDataModule(batch_size=64)
    trainer.fit(module, dm)
    assert trainer.global_step == 150
    assert int(module.state.step) == 150
    metrics = trainer.validate(module, dm, verbose=False)[0]
    assert metrics["val/accuracy"] > 0.9
    preds = trainer.predict(module, dm)
    assert sum(p.shape[0] for p in preds) == len(dm.splits["test"])


def _fit(steps_per_call: int, steps: int) -> JaxModule:
    module = JaxModule(
        MLP(features=(32,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        steps_per_call=steps_per_call,
        print_summary=False,
    )
    trainer = quiet_trainer(max_steps=steps, log_every_n_steps=4)
    trainer.fit(module, DigitsDataModule(batch_size=64 * steps_per_call))
    assert trainer.global_step == steps
    return module


def test_steps_per_call_equals_single_steps():
    # 16 steps fit in the first epoch either way, so both see the same batches in order.
    one, four = _fit(1, 16), _fit(4, 16)
    assert int(four.state.step) == 16
    assert four.compiled.train.compiles == 1
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        one.state.params,
        four.state.params,
    )


def test_early_stopping_on_a_validation_metric():
    from lightning.pytorch.callbacks import EarlyStopping

    module = JaxModule(
        MLP(features=(64,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        print_summary=False,
    )
    stop = EarlyStopping(monitor="val/accuracy", mode="max", stopping_threshold=0.9)
    trainer = quiet_trainer(max_steps=2000, callbacks=[stop])
    trainer.fit(module, DigitsDataModule(batch_size=64))
    assert trainer.global_step < 2000 and stop.stopped_epoch > 0
    assert trainer.callback_metrics["val/accuracy"] >= 0.9


def test_several_evaluation_loaders_get_exact_means_each():
    """``fit(m, train, [val_a, val_b])``: before, Lightning refused (JaxModule.validation_step
    took no ``dataloader_idx``). Each loader's epoch mean is the one a single-loader run of
    that loader gives, named as Lightning names them."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(90, 64, generator=g), torch.randint(0, 10, (90,), generator=g)
    a = DataLoader(TensorDataset(x[:50], y[:50]), batch_size=16)  # ragged last batches
    b = DataLoader(TensorDataset(x[50:], y[50:]), batch_size=32)
    module = JaxModule(
        MLP(features=(16,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        print_summary=False,
    )
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16), [a, b])
    both = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    alone = [trainer.validate(module, loader, verbose=False)[0] for loader in (a, b)]
    for i, metrics in enumerate(alone):
        for name in ("val/loss", "val/accuracy"):
            assert both[f"{name}/dataloader_idx_{i}"] == pytest.approx(metrics[name], rel=1e-6)
    tested = trainer.test(module, [a, b], verbose=False)
    assert tested[0]["test/loss/dataloader_idx_1"] == pytest.approx(alone[1]["val/loss"])
    predicted = trainer.predict(module, [a, b])
    assert [sum(len(p) for p in per) for per in predicted] == [50, 40]
