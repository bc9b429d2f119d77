import lightning as L

import jaxcore
from jaxcore.models.digits import MLP
from torchshell import JaxModule
from torchshell.data.digits import DigitsDataModule


def test_jax_module_trains_digits_under_real_trainer():
    module = JaxModule(
        MLP(features=(64,)),
        jaxcore.softmax_cross_entropy,
        jaxcore.make_optimizer(lr=1e-2),
        mesh=jaxcore.make_mesh({"data": -1, "model": 1}),
    )
    trainer = L.Trainer(
        max_steps=150,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    dm = DigitsDataModule(batch_size=64)
    trainer.fit(module, dm)
    assert trainer.global_step == 150
    assert int(module.state.step) == 150
    metrics = trainer.validate(module, dm, verbose=False)[0]
    assert metrics["val/accuracy"] > 0.9
    preds = trainer.predict(module, dm)
    assert sum(p.shape[0] for p in preds) == len(dm.splits["test"])
