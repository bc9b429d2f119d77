"""Shared test helpers."""

from typing import Any

import lightning as L


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """The real ``lightning.Trainer`` on one CPU process, without files or console output."""
    return L.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )
