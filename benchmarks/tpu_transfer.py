"""A torch batch onto the accelerator: ``bridge.to_jax`` against a bare ``jax.device_put``.

The batches of the three TPU models (``benchmarks/_gpu_modules.py``: Whisper-base log-mel
frames, ViT-B/16 images, GPT-2 token ids; float32 and int64 as a torch ``DataLoader``
yields them, collated to a dict) cross host -> device each way, per call, synced with
``jax.block_until_ready``:

- (c) coreshell: ``bridge.to_jax(batch, sharding, stats=stats)`` onto the data-parallel
  sharding over every device (as the shell places a batch: one batched ``device_put``,
  the int64 labels narrowed to int32 with a range check);
- (p) bare: ``jax.device_put`` of the same fields' numpy views (the labels already int32:
  the bare call does no narrowing), with the same shardings.

Printed: median [min-max] per call in ms, GB/s, the ratio c/p (target <= 1.05: the bridge's
checks cost next to nothing against the copy), and the bytes the bridge counted host ->
device (must equal the batch's bytes after narrowing: one copy per byte). ``--dry-run``: CPU,
tiny sizes (there the "transfer" is DLPack aliasing: zero bytes host -> device).

Run: ``.venv/bin/python benchmarks/tpu_transfer.py [--dry-run] [--repeats 30] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

import jax  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import bridge  # noqa: E402
import jaxcore  # noqa: E402
from benchmarks import _gpu_modules as gm  # noqa: E402
from benchmarks import _stats  # noqa: E402

MODELS = ("whisper", "vit", "gpt")


def _batch(name: str, size: dict[str, int], rows: int) -> dict[str, torch.Tensor]:
    """One collated batch of the model's loader, as a dict (what the shell hands over)."""
    x, y = next(iter(gm.make_loader(name, size, rows, steps=1)))
    return {"x": x, "y": y}


def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    jax.block_until_ready(fn())  # the first call: compiles nothing, warms the allocator
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - start)
    return out


def model_rows(name: str, dry: bool, repeats: int) -> list[dict[str, Any]]:
    """The two ways for one model's batch, and their ratio."""
    size = gm.SIZES[name]["tiny" if dry else "full"]
    rows_per_batch = 8 if dry else gm.BATCH[name]
    batch = _batch(name, size, rows_per_batch)
    mesh = jaxcore.make_mesh({"data": -1})
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    stats = bridge.new_stats()
    bare = {k: v.to(torch.int32) if v.dtype == torch.int64 else v for k, v in batch.items()}
    arrays = [t.numpy() for t in bare.values()]
    shardings = [NamedSharding(mesh, PartitionSpec("data", *[None] * (a.ndim - 1))) for a in arrays]
    nbytes = sum(a.nbytes for a in arrays)
    ways = {
        "(c) bridge.to_jax(batch, sharding)": lambda: bridge.to_jax(batch, sharding, stats=stats),
        "(p) jax.device_put(numpy, shardings)": lambda: jax.device_put(arrays, shardings),
    }
    label = f"tpu transfer {name} batch {rows_per_batch}, {nbytes / 2**20:.1f} MiB"
    times = {}
    rows = []
    for way, fn in ways.items():
        times[way] = _timed(fn, repeats)
        ms = [t * 1e3 for t in times[way]]
        gbps = nbytes / statistics.median(times[way]) / 1e9
        rows.append(_stats.row(label, way, "ms per batch", ms, note=f"{gbps:.2f} GB/s"))
    c, p = (statistics.median(t) for t in times.values())
    h2d = stats.host_to_device_bytes / max(stats.transfers, 1)
    note = f"bridge counted {h2d / 2**20:.1f} MiB host -> device per batch; target <= 1.05"
    rows.append(_stats.row(label, "(c)/(p)", "ratio", [c / p], note=note))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU: a smoke run")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    repeats = 3 if args.dry_run else args.repeats
    print("devices:", jax.devices(), flush=True)
    rows: list[dict[str, Any]] = []
    for name in MODELS:
        rows += model_rows(name, args.dry_run, repeats)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}))
    la = _stats.load_average()
    print(f"load average {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}")
    print(_stats.markdown(rows))


if __name__ == "__main__":
    main()
