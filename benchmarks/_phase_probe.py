"""An observer for a ``coreshell train`` child: prints one line per phase boundary to stderr.

Installed before the CLI is imported (``install()``), it wraps, without changing what they
do, the functions that start and end each phase the kill campaign aims at::

    @@phase step N            a training step starts (N steps done)
    @@phase save-start N      OrbaxCheckpointIO.save_checkpoint called
    @@phase save-returned N   ... returned (the write may go on in the background)
    @@phase commit-start/end  the manifest and rename of a checkpoint
    @@phase delete-start/end  a checkpoint removed (ckpt.keep)
    @@phase val-start/end     a validation loop
    @@phase export-start/end  the end-of-run export (not the one inside each checkpoint)
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

MARK = "@@phase"
_step = [0]


def _say(what: str) -> None:
    os.write(2, f"\n{MARK} {what} {_step[0]}\n".encode())  # unbuffered: one write


def _around(
    owner: Any, name: str, start: str, end: str, when: Callable[..., bool] | None = None
) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        on = when is None or when(*args, **kwargs)
        if on:
            _say(start)
        out = fn(*args, **kwargs)
        if on:
            _say(end)
        return out

    setattr(owner, name, wrapped)


def install() -> None:
    """Wraps the phase functions (call before the CLI module is imported)."""
    from lightning.pytorch.loops import evaluation_loop

    import torchshell.export
    from torchshell import checkpoint, module
    from torchshell.checkpoint import _files

    step_fn = module.JaxModule.training_step

    @functools.wraps(step_fn)
    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _step[0] = self.trainer.global_step
        _say("step")
        return step_fn(self, *args, **kwargs)

    module.JaxModule.training_step = training_step  # type: ignore[method-assign]
    _around(checkpoint.OrbaxCheckpointIO, "save_checkpoint", "save-start", "save-returned")
    _around(_files, "commit", "commit-start", "commit-end")
    _around(_files, "discard", "delete-start", "delete-end")
    _around(evaluation_loop._EvaluationLoop, "run", "val-start", "val-end")
    _around(
        torchshell.export,
        "export_module",
        "export-start",
        "export-end",
        when=lambda *a, **k: "/.tmp-" not in str(a[2] if len(a) > 2 else k.get("path")),
    )


def launcher(cli_module: str) -> list[str]:
    """``[python, -c, code]`` that installs this probe, then runs ``cli_module`` as main."""
    code = (
        "import importlib.util, runpy, sys\n"
        f"spec = importlib.util.spec_from_file_location('_phase_probe', {__file__!r})\n"
        "probe = importlib.util.module_from_spec(spec); spec.loader.exec_module(probe)\n"
        "probe.install()\n"
        f"sys.argv[0] = {cli_module!r}\n"
        f"runpy.run_module({cli_module!r}, run_name='__main__', alter_sys=False)\n"
    )
    return [sys.executable, "-c", code]
