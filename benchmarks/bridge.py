"""Bridge transfer benchmark: ``bridge.to_jax`` against the bare primitives, side by side.

Prints a markdown table over tensor sizes (4 KiB to 256 MiB, float32 on the host): median
and min-max per call of

- ``bridge.to_jax({"x": t}, stats=stats)`` (the bridge as the shell calls it: policy checks,
  pointer verification and stats),
- ``jnp.from_dlpack(t)`` and ``jax.device_put(t.numpy())`` (the zero-copy primitives),
- ``jnp.asarray(t.numpy())`` (the copying path a user would otherwise write),

with whether the bridge aliased the torch buffer, the ratio of the bridge to the fastest
primitive measured in the same run, and how many times faster it is than the copy.

Run: ``.venv/bin/python benchmarks/bridge.py`` (``--quick`` for fewer repeats and sizes up to
64 MiB).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# This file is named like the package it measures: drop its own folder from the import path
# so that `import bridge` below finds the package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402

KIB = 1024


def _time(fn: Callable[[], Any], repeats: int) -> list[float]:
    jax.block_until_ready(fn())  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        jax.block_until_ready(result)
        out.append(time.perf_counter() - start)
        del result
    return out


def _fmt(samples: list[float]) -> str:
    med = statistics.median(samples) * 1e6
    lo, hi = min(samples) * 1e6, max(samples) * 1e6
    if med >= 1000:
        return f"{med / 1000:.2f} ms [{lo / 1000:.2f}-{hi / 1000:.2f}]"
    return f"{med:.1f} µs [{lo:.1f}-{hi:.1f}]"


def _size(nbytes: int) -> str:
    return f"{nbytes // (KIB * KIB)} MiB" if nbytes >= KIB * KIB else f"{nbytes // KIB} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, up to 64 MiB")
    args = parser.parse_args()
    top = 64 if args.quick else 256
    sizes = [4 * KIB * 4**i for i in range(20) if 4 * KIB * 4**i <= top * KIB * KIB]
    zero_repeats = 50 if args.quick else 300

    print(f"jax {jax.__version__}, torch {torch.__version__}, {jax.devices()[0]}; float32 tensors")
    print("median per call [min-max]\n")
    print(
        "| size | bridge.to_jax | jnp.from_dlpack | jax.device_put(numpy view) | "
        "jnp.asarray(t.numpy()) (copy) | zero-copy | bridge / fastest primitive | "
        "copy / bridge |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        stats = bridge.new_stats()
        probe = bridge.to_jax({"x": t}, stats=stats)["x"]
        zero = probe.unsafe_buffer_pointer() == t.data_ptr() and stats.copied_bytes == 0
        del probe
        copy_repeats = max(5, min(zero_repeats, (64 * KIB * KIB) // nbytes * 5))
        runs = {
            "bridge": _time(lambda t=t, s=stats: bridge.to_jax({"x": t}, stats=s), zero_repeats),
            "dlpack": _time(lambda t=t: jnp.from_dlpack(t), zero_repeats),
            "device_put": _time(lambda t=t: jax.device_put(t.numpy()), zero_repeats),
            "copy": _time(lambda t=t: jnp.asarray(t.numpy()), copy_repeats),
        }
        med = {k: statistics.median(v) for k, v in runs.items()}
        fastest = min(med["dlpack"], med["device_put"])
        print(
            f"| {_size(nbytes)} | {_fmt(runs['bridge'])} | {_fmt(runs['dlpack'])} | "
            f"{_fmt(runs['device_put'])} | {_fmt(runs['copy'])} | {'yes' if zero else 'NO'} | "
            f"{med['bridge'] / fastest:.2f}x | {med['copy'] / med['bridge']:.0f}x |"
        )
        del t


if __name__ == "__main__":
    main()
