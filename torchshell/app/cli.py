"""The ``coreshell`` command: ``train``, ``export``, ``doctor``, ``launch``, ``predict``, ``serve``.

Every coreshell error that reaches here (config, mesh, sharding, data, checkpoint, export,
tracking, distributed) prints as one block, what was expected, what came in and the fix, and
exits 2 for bad input (the ``ValueError`` family) or 1 for a failure. Anything else is a bug
and keeps its traceback. ``--verbose`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback of
every error and the library warnings the quiet console leaves out.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchshell.app.failures import BAD_INPUT, our_errors, report
from torchshell.app.quiet import verbose

USAGE = """usage: coreshell [--verbose] COMMAND [ARGS...]

  train    train with the Hydra config in conf/ (e.g. trainer.max_steps=200 optim.lr=1e-3)
           recipe=digits | recipe=spoken_digits picks a whole recipe (data + model);
           add --cfg job to print the resolved config, -m for a multirun sweep
  export   RUN_DIR --format safetensors|torch|onnx: the trained torch twin's weights
  doctor   [OVERRIDES...]: pre-flight checks of a config, without training
  predict  RUN_OR_MODEL FILES_OR_FOLDER...: WAV files in, one JSON line per file out
  serve    RUN [--triton] [--port P]: the speech model over HTTP on 127.0.0.1 (--triton: the
           JAX core through PyTriton)
  launch   --nproc N [--devices-per-proc K] -- train [OVERRIDES...]: N local processes on
           JAX's distributed runtime
  tracking replay [PATH...]: send the MLflow records runs could not deliver (store down)

  --verbose  keep library warnings and show the traceback of every error
"""


def guarded(command: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn``; a coreshell error becomes one block and ``SystemExit`` (2 or 1).

    Example:
        >>> guarded("doctor", lambda: 0)
        0
    """
    if verbose():
        return fn()
    try:
        return fn()
    except our_errors() as err:
        raise SystemExit(report(command, err)) from None


def _train_task(cfg: Any, base: Any = None) -> None:
    from hydra.core.hydra_config import HydraConfig

    from torchshell.app.config import typed
    from torchshell.app.overrides import run_name
    from torchshell.app.quiet import configure

    configure(verbose())
    hydra_cfg = HydraConfig.get()
    out_dir = Path(hydra_cfg.runtime.output_dir)

    def run() -> Any:
        config = typed(cfg)  # a refused config is told before Lightning and MLflow load
        if not config.tracking.run_name:  # named by what ran, not MLflow's random words
            config.tracking.run_name = run_name(config, cfg, hydra_cfg.overrides.task, base)
        from torchshell.app.train import train

        return train(config, out_dir)

    guarded("train", run)


def _train_main(argv: Sequence[str]) -> None:
    import hydra

    from torchshell.app.config import config_dir, register_configs
    from torchshell.app.overrides import base_config, check_overrides
    from torchshell.app.quiet import configure

    configure(verbose())
    register_configs()
    base = base_config(argv)
    guarded("train", lambda: check_overrides(argv, base))  # before Hydra's `+key` advice
    started: list[bool] = []

    def task(cfg: Any) -> None:
        started.append(True)
        _train_task(cfg, base)

    sys.argv = [f"{Path(sys.argv[0]).name} train", *argv]
    try:
        hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(task)()
    except SystemExit as stop:
        if stop.code == 1 and not started:  # Hydra refused the overrides: bad input
            raise SystemExit(BAD_INPUT) from None
        raise


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``coreshell`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in args[:1]:
        args = args[1:]
        os.environ["CORESHELL_VERBOSE"] = "1"  # read by this process and its children
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    from torchshell.app.quiet import configure

    configure(verbose())  # every command's console: the known library noise left out
    if command == "train":
        _train_main(rest)
    elif command == "export":
        from torchshell.app.export_cli import export_command

        guarded("export", lambda: export_command(rest))
    elif command == "launch":
        from torchshell.app.launch import launch_command

        raise SystemExit(guarded("launch", lambda: launch_command(rest)))
    elif command == "tracking":
        from torchshell.app.tracking_cli import tracking_command

        raise SystemExit(guarded("tracking", lambda: tracking_command(rest)))
    elif command == "doctor":
        from torchshell.app.doctor import doctor_command

        raise SystemExit(guarded("doctor", lambda: doctor_command(rest)))
    elif command == "predict":
        from torchshell.app.predict import predict_command

        raise SystemExit(guarded("predict", lambda: predict_command(rest)))
    elif command == "serve":
        from torchshell.app.serve import serve_command

        raise SystemExit(guarded("serve", lambda: serve_command(rest)))
    else:
        print(f"coreshell: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(BAD_INPUT)


if __name__ == "__main__":
    main()
