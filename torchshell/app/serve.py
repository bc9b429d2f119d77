"""``coreshell serve RUN [--triton]``: the speech model of a run over HTTP on 127.0.0.1.

- ``--triton``: the **JAX core** (the trained Flax encoder, jitted) behind Triton through
  PyTriton (``pip install 'coreshell[triton]'``), with Triton's dynamic batching. The
  torchaudio front-end (the same code as the exported model's) turns waveforms into
  features; the encoder runs in JAX. Inputs ``waveform`` FP32 ``[B, N]`` and ``lengths`` INT64
  ``[B, 1]``; outputs ``logits``, ``probabilities``, ``label``.
- without it: the exported MLflow model (the pyfunc over the JAX core, ONNX Runtime for
  small batches: :mod:`torchshell.app.served_core`) through ``mlflow models serve
  --env-manager local``; the request format is in ``docs/serving.md``.

Two things stop PyTriton 0.7.0's Python backend stub on this kind of machine, each handled
in :func:`triton_environment`: the stub links ``libpython3.11.so`` dynamically and, without
a path to ours, loads the system's (Debian's 3.11.2) under our interpreter's 3.11.7 standard
library, whose ``resource_tracker`` calls ``RLock._recursion_count`` that 3.11.2's C RLock lacks
(``AttributeError: '_thread.RLock' object has no attribute '_recursion_count'``); and the stub
is built against numpy 1.x (PyTriton pins ``numpy<2``; jax needs ``numpy>=2``): under numpy
2 every output comes back empty (``output tensor shape does not match size of output``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchshell._errors import ConfigError
from torchshell.app import quiet
from torchshell.app.stopping import announce, port_answers, run_whole, stop_signals

FRAME_STEP = 64  # features are padded to a multiple of this many frames: few compiled shapes
STUB_PACKAGES = ("numpy<2", "pyzmq")


class JaxCore:
    """The trained Flax encoder of a run, jitted, behind the exported model's front-end.

    Args:
        config: the run's ``config.yaml``.
        weights: its ``export/model.safetensors`` (imported into the Flax params).

    Example:
        >>> run = Path("outputs/2026-12-01/12-00-00")  # a run directory of `coreshell train`
        >>> core = JaxCore(run / "config.yaml", run / "export/model.safetensors")  # doctest: +SKIP
        >>> core.logits(np.zeros((1, 8000), np.float32), np.array([8000])).shape  # doctest: +SKIP
        (1, 10)
    """

    def __init__(self, config: Path, weights: Path) -> None:
        import jax
        from hydra.utils import instantiate
        from omegaconf import OmegaConf

        import bridge
        from torchshell.app.export_cli import load_twin

        twin: Any
        twin, _ = load_twin(config, weights)
        if not hasattr(twin, "serving"):
            raise ConfigError(
                f"The twin of {config} ({type(twin).__name__}) has no serving() front-end, so "
                "it takes no waveforms. Fix: serve a speech recipe's run."
            )
        self.front_end = twin.serving()
        model = instantiate(OmegaConf.load(config).model.flax, _convert_="all")
        features, frame_mask = (t.numpy() for t in twin.example_input(2))
        template = model.init(jax.random.key(0), features, frame_mask)
        state_dict, _ = bridge.load_safetensors(weights)
        self.variables = bridge.import_state_dict(state_dict, template)
        self._apply = jax.jit(lambda v, f, m: model.apply(v, f, m))
        from torchshell.app.served import serving_spec

        self.spec = serving_spec(self.front_end, int(self.logits_of(features, frame_mask).shape[1]))

    def logits_of(self, features: np.ndarray, frame_mask: np.ndarray) -> np.ndarray:
        """The jitted encoder on features ``[B, T, n_mels]`` and ``frame_mask[B, T]``."""
        return np.asarray(self._apply(self.variables, features, frame_mask))

    def logits(self, waveform: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Logits ``[B, C]`` of a padded batch of 16 kHz clips and their lengths in samples.

        Raises:
            ValueError: a request the served model refuses too (the message says the fix).
        """
        import torch
        from mlflow.exceptions import MlflowException

        from torchshell.app.waveform_model import validated

        try:
            waveform, lengths = validated({"waveform": waveform, "lengths": lengths}, self.spec)
        except MlflowException as err:
            raise ValueError(err.message) from None
        with torch.no_grad():
            features, mask = self.front_end.features(
                torch.from_numpy(waveform), torch.from_numpy(lengths)
            )
        b, t = mask.shape
        rows, frames = 1 << (b - 1).bit_length(), -(-t // FRAME_STEP) * FRAME_STEP
        f = np.zeros((rows, frames, features.shape[2]), np.float32)
        m = np.zeros((rows, frames), bool)
        f[:b, :t], m[:b, :t] = features.numpy(), mask.numpy()
        return self.logits_of(f, m)[:b]


def stub_env_path() -> Path:
    """Where the Triton stub's own environment lives (``CORESHELL_TRITON_STUB_ENV`` or cache).

    Example:
        >>> stub_env_path().name.startswith("triton-stub-py")
        True
    """
    default = (
        Path.home()
        / ".cache"
        / "coreshell"
        / f"triton-stub-py{sys.version_info[0]}{sys.version_info[1]}"
    )
    return Path(os.environ.get("CORESHELL_TRITON_STUB_ENV", default))


def ensure_stub_env(path: Path) -> Path:
    """A virtual environment of this interpreter with ``numpy<2`` and ``pyzmq`` for the stub.

    Built once (``python -m venv`` + ``pip install``, ~40 s) and reused.

    Raises:
        ConfigError: it cannot be built (no registry access): the commands to run by hand.
    """
    python = path / "bin" / "python"
    probe = "import numpy, zmq; assert int(numpy.__version__.split('.')[0]) < 2"
    if (
        python.is_file()
        and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    ):
        return path
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    print(
        f"coreshell serve: building the Triton stub environment at {path} (once)", file=sys.stderr
    )
    steps = [
        [str(base), "-m", "venv", str(path)],
        [str(path / "bin" / "pip"), "install", "-q", *STUB_PACKAGES],
    ]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode:
            raise ConfigError(
                f"Could not build the Triton stub environment at {path}: {' '.join(step)} "
                f"exited {proc.returncode} ({proc.stderr.strip()[-300:]}). Fix: run `{base} -m "
                f"venv {path} && {path}/bin/pip install 'numpy<2' pyzmq`, or point "
                "CORESHELL_TRITON_STUB_ENV at such an environment."
            )
    return path


@contextlib.contextmanager
def triton_environment(stub_env: Path) -> Iterator[None]:
    """While Triton starts: our own libpython first on the loader path, the stub's numpy<2 env.

    Both are undone when the block ends (the server process keeps what it started with).
    """
    import pytriton.server.triton_server as triton_server

    lib = str(sysconfig.get_config_var("LIBDIR"))
    before = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = lib + (f":{before}" if before else "")
    chooser = triton_server.get_triton_python_backend_python_env
    triton_server.get_triton_python_backend_python_env = lambda: stub_env
    try:
        yield
    finally:
        triton_server.get_triton_python_backend_python_env = chooser
        if before is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = before


@contextlib.contextmanager
def triton_server(
    core: JaxCore,
    *,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    model_name: str = "spoken_digits",
    max_batch_size: int = 64,
    queue_delay_us: int = 2000,
) -> Iterator[Any]:
    """PyTriton serving ``core`` with dynamic batching; yields the running ``Triton``.

    Example:
        >>> with triton_server(core, http_port=8000) as triton:  # doctest: +SKIP
        ...     pass  # POST http://127.0.0.1:8000/v2/models/spoken_digits/infer
    """
    try:
        from pytriton.decorators import batch
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig
    except ImportError as err:
        raise ConfigError(
            f"--triton needs PyTriton ({err}). Fix: pip install 'coreshell[triton]'."
        ) from err

    classes = int(core.spec["num_classes"])

    @batch
    def infer(waveform: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        logits = core.logits(waveform, lengths.reshape(-1))
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return {
            "logits": logits.astype(np.float32),
            "probabilities": (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32),
            "label": logits.argmax(axis=1).astype(np.int64)[:, None],
        }

    config = TritonConfig(
        http_address=host,
        http_port=http_port,
        grpc_address=host,
        grpc_port=grpc_port,
        allow_metrics=False,
        exit_timeout_secs=5,
    )
    stub_env = ensure_stub_env(stub_env_path())
    with triton_environment(stub_env), warnings.catch_warnings():
        # PyTriton starts tritonserver through `sh`, which forks and at once execs the binary:
        # no JAX code runs in the child, so JAX's fork warning does not apply
        warnings.filterwarnings(
            "ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning, module="sh"
        )
        triton = Triton(config=config)
        triton.bind(
            model_name=model_name,
            infer_func=infer,
            inputs=[
                Tensor(name="waveform", dtype=np.float32, shape=(-1,)),
                Tensor(name="lengths", dtype=np.int64, shape=(1,)),
            ],
            outputs=[
                Tensor(name="logits", dtype=np.float32, shape=(classes,)),
                Tensor(name="probabilities", dtype=np.float32, shape=(classes,)),
                Tensor(name="label", dtype=np.int64, shape=(1,)),
            ],
            config=ModelConfig(
                max_batch_size=max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=queue_delay_us),
            ),
            strict=True,
        )
        triton.run()
    try:
        yield triton
    finally:
        triton.stop()


def model_uri(source: str, tracking_uri: str, work: Path) -> str:
    """The MLflow model URI of a run: its model, or one exported now from a run directory.

    Args:
        source: a local MLflow model directory (with ``MLmodel``), a model URI, an MLflow run
            id (its ``model``), or a run directory (``config.yaml`` +
            ``export/model.safetensors``: exported into ``work`` as ``coreshell train`` logs it).
        tracking_uri: the store of a run id.
        work: scratch folder.

    Example:
        >>> model_uri("runs:/abc/model", "sqlite:///mlflow.db", Path("."))
        'runs:/abc/model'
    """
    from torchshell.app.export_cli import load_twin, resolve_source

    path = Path(source)
    if path.is_dir() and (path / "MLmodel").is_file():
        return str(path)
    if ":/" in source and not path.exists():
        return source
    config, weights = resolve_source(source, tracking_uri, work)
    if not path.is_dir():
        return f"runs:/{source}/model"
    twin: Any
    twin, _ = load_twin(config, weights)
    if not hasattr(twin, "serving"):
        raise ConfigError(
            f"The twin of {source} ({type(twin).__name__}) has no serving() module, so it takes "
            "no waveforms. Fix: pass a speech recipe's run."
        )
    from torchshell.app.served import save_waveform_model

    with quiet.torch_export_notes():
        save_waveform_model(twin.serving(), work / "model")
    return str(work / "model")


def serve_command(argv: list[str]) -> int:
    """``coreshell serve RUN [--triton] [--host H] [--port P]``; blocks until interrupted."""
    parser = argparse.ArgumentParser(
        prog="coreshell serve", description="Serve a speech run's model over HTTP."
    )
    parser.add_argument("source", metavar="RUN", help="a run directory, run id or model URI")
    parser.add_argument("--triton", action="store_true", help="the JAX core through PyTriton")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port")
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="MLflow store")
    args = parser.parse_args(argv)
    try:  # SIGTERM as SIGINT: the server's process group stopped, the temporary folder removed
        with stop_signals():
            return _serve(args)
    except KeyboardInterrupt:
        return 0


def _serve(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as work:
        if args.triton:
            from torchshell.app.export_cli import resolve_source

            config, weights = resolve_source(args.source, args.tracking_uri, Path(work))
            core = JaxCore(config, weights)
            with triton_server(
                core, host=args.host, http_port=args.port, grpc_port=args.grpc_port
            ) as triton:
                print(
                    f"coreshell serve: Triton at http://{args.host}:{args.port}/v2/models/"
                    "spoken_digits/infer (Ctrl-C stops)",
                    file=sys.stderr,
                )
                triton.serve()
            return 0
        if port_answers(args.host, args.port):  # (else the line below would be its answer)
            raise ConfigError(
                f"Something already answers on {args.host}:{args.port}. Fix: pass another "
                "--port, or stop the server there."
            )
        uri = model_uri(args.source, args.tracking_uri, Path(work))
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "models",
            "serve",
            "-m",
            uri,
            "--env-manager",
            "local",
            "-h",
            args.host,
            "-p",
            str(args.port),
        ]
        env = {**os.environ, "MLFLOW_TRACKING_URI": args.tracking_uri}
        # MLflow execs `uvicorn` through the shell: this environment's scripts first on PATH
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        if not quiet.verbose():
            env.update(quiet.server_env(Path(work)))
        url = f"http://{args.host}:{args.port}"
        announce(
            args.host,
            args.port,
            f"coreshell serve: {uri} answering at {url}/invocations (Ctrl-C stops)",
        )
        return run_whole(cmd, env)
