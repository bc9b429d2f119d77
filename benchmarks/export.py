"""Export speed: a ~100M-parameter Flax tree to safetensors, against a plain memcpy.

A tree of Dense layers (``layers_i/kernel [2048, 2048]`` + bias, float32, ~100M params, ~400
MB) is turned into a PyTorch ``state_dict`` by ``bridge.export_state_dict`` (DLPack views;
kernels transposed to torch's ``(out, in)``) and written by ``bridge.save_safetensors``
(contiguous copies where needed, one atomic file). Throughput is in GB/s of parameter bytes,
side by side with two floors measured in the same run on the same bytes: a plain in-memory
copy (``np.copyto`` into a preallocated buffer) and a plain file write of one buffer.
Medians and min-max over the repeats; the first pass of each is an untimed warm-up.

Run: ``.venv/bin/python benchmarks/export.py`` (``--tiny`` for ~1M params, ``--json PATH``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Named like the function it measures; keep `import bridge` on the package (see bridge.py).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bridge  # noqa: E402
from benchmarks import _stats  # noqa: E402

BENCH = "export"


def make_tree(layers: int, width: int) -> dict[str, Any]:
    """``{"layers_i": {"kernel": [w, w], "bias": [w]}}`` in float32, on the default device."""
    key = jax.random.key(0)
    tree = {}
    for i in range(layers):
        key, sub = jax.random.split(key)
        tree[f"layers_{i}"] = {
            "kernel": jax.random.normal(sub, (width, width), jnp.float32),
            "bias": jnp.zeros((width,), jnp.float32),
        }
    return jax.block_until_ready(tree)


def _times(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="2 layers of 512, 2 repeats")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.width, args.repeats = 2, 512, 2

    tree = make_tree(args.layers, args.width)
    leaves = jax.tree.leaves(tree)
    params = sum(x.size for x in leaves)
    nbytes = sum(x.nbytes for x in leaves)
    gb = nbytes / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "model.safetensors"
        holder: dict[str, Any] = {}

        def export() -> None:
            holder["sd"] = bridge.export_state_dict(tree)

        def save() -> None:
            bridge.save_safetensors(holder["sd"], target)

        def both() -> None:
            bridge.save_safetensors(bridge.export_state_dict(tree), target)

        src = np.ones(nbytes, np.uint8)
        dst = np.empty_like(src)
        raw = Path(tmp) / "raw.bin"

        def memcpy() -> None:
            np.copyto(dst, src)

        def write() -> None:
            with open(raw, "wb") as f:
                f.write(memoryview(src))

        runs = {
            "bridge.export_state_dict": _times(export, args.repeats),
            "bridge.save_safetensors": _times(save, args.repeats),
            "export + save (end to end)": _times(both, args.repeats),
            "memcpy of the same bytes": _times(memcpy, args.repeats),
            "plain file write of the same bytes": _times(write, args.repeats),
        }
        written = target.stat().st_size
    memcpy_rate = float(np.median([gb / s for s in runs["memcpy of the same bytes"]]))
    rows = []
    for name, seconds in runs.items():
        rates = [gb / s for s in seconds]
        rows.append(
            _stats.row(
                f"{BENCH}/{params / 1e6:.0f}M params",
                name,
                "GB/s",
                rates,
                ratio=float(np.median(rates)) / memcpy_rate,
                ratio_to="memcpy",
                note=f"{float(np.median(seconds)):.3g} s",
            )
        )
    print(
        f"{params:,} params, {nbytes / 1e6:,.0f} MB float32 ({written / 1e6:,.0f} MB file), "
        f"{args.repeats} repeats, load average {_stats.load_average()[0]:.1f}\n"
    )
    print(_stats.markdown(rows))
    if args.json:
        _stats.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
