"""Inference of the spoken-digits encoder: the jitted JAX core against every torch-side server.

The model is the spoken-digits recipe's encoder (width 64, 2 blocks, 40 mels, 64 frames of
log-mel features), **random init** (latency and throughput do not depend on the weights; the
recipe's training is ``coreshell train``'s business). Its Flax params are exported to the torch
twin with :func:`torchshell.export.export_twin`; every path gets the same inputs and its
outputs are checked equal to the JAX core's within 1e-4:

- JAX core: ``jax.jit`` of the Flax apply (eval), numpy in, numpy out;
- torch twin, eager (``torch.inference_mode``), and ``torch.compile`` (inductor; ``--tiny``
  uses the ``eager`` backend: dynamo's capture and guards only, no C++ compiler, and none of
  AOTAutograd's re-tracing at each new batch size);
- the pt2 program MLflow serves (``torch.export`` with the twin's dynamic axes,
  :func:`torchshell.export.export_program`, saved and loaded back as a ``.pt2`` archive);
- ONNX Runtime on the ONNX export (:func:`torchshell.export.write_onnx`);
- ``mlflow models serve`` over HTTP on 127.0.0.1 (the twin saved with ``mlflow.pytorch``,
  pt2 serialization): requests/s at 4 concurrent clients, a bounded number of requests.

Batch-1 latency as p50/p99 over ``--requests`` calls; batch-64 throughput as rows/s.

Run: ``.venv/bin/python benchmarks/inference.py [--tiny] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import _stats  # noqa: E402

Row = dict[str, Any]
Fn = Callable[[np.ndarray, np.ndarray], np.ndarray]
FRAMES, MELS, ATOL = 64, 40, 1e-4
BENCH = "inference/spoken-digits encoder (random init)"


def _inputs(batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(batch, FRAMES, MELS)).astype(np.float32)
    lengths = rng.integers(FRAMES // 2, FRAMES + 1, batch)
    return features, np.arange(FRAMES)[None, :] < lengths[:, None]


def build() -> tuple[Any, Any, torch.nn.Module]:
    """``(flax model, params, torch twin holding the same weights)``."""
    from jaxcore.models.spoken_digits import SpokenDigitsEncoder
    from torchshell.export import export_twin
    from torchshell.twins.spoken_digits import SpokenDigitsEncoder as Twin

    model = SpokenDigitsEncoder(width=64, depth=2, heads=4, dropout=0.0)
    f, m = _inputs(2)
    params = model.init(jax.random.key(0), jnp.asarray(f), jnp.asarray(m))["params"]
    twin = Twin(n_mels=MELS, width=64, depth=2, heads=4, dropout=0.0)
    export_twin(params, twin, Path(tempfile.mkdtemp()) / "twin.safetensors")
    return model, params, twin.eval()


def jax_core(model: Any, params: Any) -> Fn:
    apply = jax.jit(lambda p, f, m: model.apply({"params": p}, f, m, train=False))

    def run(f: np.ndarray, m: np.ndarray) -> np.ndarray:
        return np.asarray(apply(params, f, m))

    return run


def torch_fn(module: Any) -> Fn:
    def run(f: np.ndarray, m: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return module(torch.from_numpy(f), torch.from_numpy(m)).numpy()  # type: ignore[no-any-return]

    return run


def pt2_fn(twin: torch.nn.Module, tmp: Path) -> Fn:
    from torchshell.export import export_program

    program = export_program(twin, twin.example_input(2))
    torch.export.save(program, tmp / "encoder.pt2")
    return torch_fn(torch.export.load(tmp / "encoder.pt2").module())


def onnx_fn(twin: torch.nn.Module, tmp: Path) -> Fn:
    import onnxruntime as ort

    from torchshell.export import write_onnx

    write_onnx(twin, tmp / "encoder.onnx")
    session = ort.InferenceSession(str(tmp / "encoder.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(f: np.ndarray, m: np.ndarray) -> np.ndarray:
        return session.run(None, dict(zip(names, (f, m), strict=True)))[0]  # type: ignore[no-any-return]

    return run


def latency(fn: Fn, requests: int) -> list[float]:
    """Batch-1 call times in ms (each call on fresh inputs; after one untimed call, which
    compiles the batch-1 shape where a path compiles per shape)."""
    fn(*_inputs(1, seed=requests))
    times = []
    for i in range(requests):
        f, m = _inputs(1, seed=i)
        t0 = time.perf_counter()
        fn(f, m)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def throughput(fn: Fn, calls: int) -> float:
    f, m = _inputs(64, seed=1)
    fn(f, m)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(f, m)
    return 64 * calls / (time.perf_counter() - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Packed(torch.nn.Module):
    """The twin behind one input tensor ``[B, T, mels + 1]`` (the last channel: the frame
    mask), the single-array input MLflow's pyfunc and its JSON take."""

    def __init__(self, twin: torch.nn.Module) -> None:
        super().__init__()
        self.twin = twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.twin(x[..., :-1], x[..., -1] > 0.5)  # type: ignore[no-any-return]


def _packed(f: np.ndarray, m: np.ndarray) -> np.ndarray:
    return np.concatenate([f, m[..., None].astype(np.float32)], axis=-1)


def serve_rate(twin: torch.nn.Module, tmp: Path, requests: int, want: np.ndarray) -> Row:
    """``mlflow models serve`` on 127.0.0.1: requests/s at 4 concurrent clients."""
    import mlflow

    f, m = _inputs(1, seed=0)
    x = _packed(f, m)
    path = tmp / "mlflow-model"
    mlflow.pytorch.save_model(
        Packed(twin).eval(),
        str(path),
        input_example=x,
        pip_requirements=["torch"],
        serialization_format="pt2",
    )
    port = _free_port()
    log = (tmp / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(path), "--env-manager",
         "local", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the server's workers end with it
        # mlflow execs `uvicorn` by name: this interpreter's bin folder first on PATH
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"},
    )  # fmt: skip
    body = json.dumps({"inputs": x.tolist()}).encode()

    def post() -> np.ndarray:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            body,
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return np.asarray(json.loads(r.read())["predictions"], np.float32)

    try:
        deadline = time.monotonic() + 600  # (gunicorn, torch and the pt2 load: slow under load)
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    tail = (tmp / "serve.log").read_text()[-3000:]
                    raise RuntimeError(f"mlflow models serve did not come up:\n{tail}") from None
                time.sleep(0.5)
        got = post()
        diff = float(np.max(np.abs(got.reshape(want.shape) - want)))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: post(), range(requests)))
        rate = requests / (time.perf_counter() - t0)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()
    return _stats.row(
        BENCH,
        "mlflow models serve (HTTP, pt2), 4 clients",
        "requests/s",
        [rate],
        note=f"batch 1, {requests} requests; max |diff| {diff:.1e}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="batch-1 calls per path")
    parser.add_argument("--calls", type=int, default=50, help="batch-64 calls per path")
    parser.add_argument("--tiny", action="store_true", help="smoke run: few calls")
    parser.add_argument("--no-serve", action="store_true", help="skip mlflow models serve")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*input_example.*")
    if args.tiny:
        args.requests, args.calls = 5, 2
    tmp = Path(tempfile.mkdtemp(prefix="coreshell-inference-"))
    model, params, twin = build()
    backend = "eager" if args.tiny else "inductor"
    paths: dict[str, Fn] = {
        "JAX core (jax.jit)": jax_core(model, params),
        "torch twin, eager": torch_fn(twin),
        f"torch twin, torch.compile ({backend})": torch_fn(torch.compile(twin, backend=backend)),
        "pt2 program (torch.export, as MLflow serves it)": pt2_fn(twin, tmp),
        "ONNX Runtime (CPU)": onnx_fn(twin, tmp),
    }
    check = _inputs(5, seed=7)
    want = paths["JAX core (jax.jit)"](*check)
    rows: list[Row] = []
    for name, fn in paths.items():
        diff = float(np.max(np.abs(fn(*check) - want)))
        if diff > ATOL:
            raise SystemExit(f"{name}: outputs differ from the JAX core by {diff:.2e} > {ATOL}")
        lat = latency(fn, args.requests)
        p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
        row = _stats.row(BENCH, f"{name}: batch 1", "ms", lat, note=f"p99 {p99:.3f} ms")
        row["median"], row["p99"] = float(p50), float(p99)
        rows.append(row)
        rows.append(
            _stats.row(
                BENCH,
                f"{name}: batch 64",
                "rows/s",
                [throughput(fn, args.calls)],
                note=f"max |diff| vs JAX {diff:.1e}",
            )
        )
    if not args.no_serve:
        one = _inputs(1, seed=0)
        rows.append(
            serve_rate(twin, tmp, 8 if args.tiny else 200, paths["torch twin, eager"](*one))
        )
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, _stats.machine())


if __name__ == "__main__":
    main()
