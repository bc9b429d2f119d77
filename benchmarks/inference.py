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
- ``mlflow models serve`` over HTTP on 127.0.0.1 of the served model as ``coreshell train``
  logs it (waveforms in: the front end too), before issue #54 (the ``torch.export`` program)
  and after (the JAX core, ONNX Runtime for batches of up to 4), side by side: p50 latency
  and requests/s at 4 clients, batch 1 and 64, and each model's ``predict`` in process
  (:mod:`benchmarks._served`).

Batch-1 latency as p50/p99 over ``--requests`` calls; batch-64 throughput as rows/s.

Run: ``.venv/bin/python benchmarks/inference.py [--tiny] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import _served, _stats  # noqa: E402

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

    make: Any = twin.example_input  # the twin's own method
    program = export_program(twin, make(2))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="batch-1 calls per path")
    parser.add_argument("--calls", type=int, default=50, help="batch-64 calls per path")
    parser.add_argument("--tiny", action="store_true", help="smoke run: few calls")
    parser.add_argument("--no-serve", action="store_true", help="skip mlflow models serve")
    parser.add_argument(
        "--serve-only", action="store_true", help="only mlflow models serve, before and after"
    )
    parser.add_argument(
        "--two-parses",
        action="store_true",
        help="also serve the JAX core under MLflow's two JSON parses of a request",
    )
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*input_example.*")
    if args.tiny:
        args.requests, args.calls = 5, 2
    tmp = Path(tempfile.mkdtemp(prefix="coreshell-inference-"))
    model, params, twin = build()
    rows: list[Row] = []
    paths: dict[str, Fn] = {}
    if args.serve_only:
        args.no_serve = False
    else:
        backend = "eager" if args.tiny else "inductor"
        paths = {
            "JAX core (jax.jit)": jax_core(model, params),
            "torch twin, eager": torch_fn(twin),
            f"torch twin, torch.compile ({backend})": torch_fn(
                torch.compile(twin, backend=backend)
            ),
            "pt2 program (torch.export, as MLflow serves it)": pt2_fn(twin, tmp),
            "ONNX Runtime (CPU)": onnx_fn(twin, tmp),
        }
    check = _inputs(5, seed=7)
    want = jax_core(model, params)(*check)
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
    if not args.no_serve:  # the served model, as `coreshell train` logs it, before and after
        counts = {1: (5, 8), 64: (2, 4)} if args.tiny else {1: (100, 200), 64: (10, 20)}
        serving: Any = twin.serving  # the twin's own method
        cores = _served.TWO_PARSES if args.two_parses else _served.CORES
        rows += _served.served_rows(serving(), tmp, BENCH, counts, cores)
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows, _stats.machine())


if __name__ == "__main__":
    main()
