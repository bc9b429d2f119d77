"""Attention on a TPU: forward + backward of ``jaxcore.models.attention.attend`` with each
implementation, at the attention shapes of the three TPU models (bfloat16).

Shapes ``[B, T, N, H]``: the Whisper-base-sized encoder ``[16, 1500, 8, 64]`` (full), GPT-2
small ``[8, 1024, 12, 64]`` (causal), ViT-B/16 ``[64, 197, 12, 64]`` (full). Per shape and
implementation: one jitted ``jax.grad`` of ``sum(attend(q, k, v) * w)`` with respect to q, k
and v (the forward and the whole backward), two warm-up calls (the first compiles), then
``--repeats`` timed calls each synced with ``jax.block_until_ready``: median [min-max] ms.

Rows: ``xla``, ``flash`` (the Pallas flash kernel), ``splash`` (splash attention, its block by
``splash_block``), ``default`` (``implementation=None``: what a model gets; the kernel it took
in brackets), and splash variants for tuning: ``splash two-kernel bwd`` (dq apart from dk and
dv; the default fuses them) and ``splash block B`` for each ``--blocks`` size unlike the
default block and not past the padded length. ``TFLOP/s`` counts the model's attention FLOPs
only, ``3 x 4 B N T S H`` (halved when causal): no recompute, no padding. A cell that fails (a
kernel refusing the shape, a Mosaic compile error) is a FAILED row with the error's first line;
the others still run. ``vs xla`` is XLA's time over the row's.

``--dry-run``: tiny shapes on the CPU, the Pallas kernels in interpret mode, one timed call,
no splash variants (the numbers mean nothing there; the suite runs it to keep the script
working).

Run (on the TPU machine): ``python benchmarks/attention_tpu.py [--repeats 20] [--blocks
256,512,1024] [--json PATH]``; here: ``python benchmarks/attention_tpu.py --dry-run``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # the repository: `benchmarks._x` helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import _stats  # noqa: E402
from jaxcore.models import _tpu_attention  # noqa: E402
from jaxcore.models.attention import attend  # noqa: E402

# name: (B, T, N, H, causal)
SHAPES = {
    "encoder": (16, 1500, 8, 64, False),
    "gpt2": (8, 1024, 12, 64, True),
    "vit": (64, 197, 12, 64, False),
}
DRY_SHAPES = {  # tiny, one kernel block each, still padded (T not a multiple of 128)
    "encoder": (1, 100, 1, 32, False),
    "gpt2": (1, 70, 1, 32, True),
    "vit": (1, 40, 1, 32, False),
}
IMPLEMENTATIONS = ("xla", "flash", "splash", "default")


def _inputs(shape: tuple[int, int, int, int, bool]) -> tuple[jax.Array, ...]:
    b, t, n, h, _ = shape
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, (b, t, n, h), jnp.bfloat16) for k in keys)


def _step(attention: Callable[..., jax.Array], h: int) -> Callable[..., Any]:
    """The jitted forward + backward of one attention call."""
    weights = jnp.cos(jnp.arange(h, dtype=jnp.float32))

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * weights)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _cases(
    shape: tuple[int, int, int, int, bool], blocks: list[int] | None, interpret: bool
) -> dict[str, Callable[..., jax.Array]]:
    """The row name -> ``(q, k, v) -> out`` of every implementation measured at ``shape``, and
    the splash variants unless ``blocks`` is ``None``."""
    causal = shape[4]

    def by_name(name: str | None) -> Callable[..., jax.Array]:
        return lambda q, k, v: attend(
            q, k, v, is_causal=causal, implementation=name, interpret=interpret
        )

    def splash(**kw: Any) -> Callable[..., jax.Array]:
        return lambda q, k, v: _tpu_attention.splash(q, k, v, None, causal, None, interpret, **kw)

    cases = {name: by_name(None if name == "default" else name) for name in IMPLEMENTATIONS}
    if blocks is None:
        return cases
    cases["splash two-kernel bwd"] = splash(fused_backward=False)
    auto, padded = _tpu_attention.splash_block(shape[1])
    for block in blocks:
        if block != auto and block <= -(-padded // 128) * 128:
            cases[f"splash block {block}"] = splash(block=block)
    return cases


def _kernel_taken(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...]) -> str:
    """Which implementation ``fn`` traced to: splash, flash (a Pallas call) or xla."""
    text = str(jax.make_jaxpr(fn)(*args))
    return "splash" if "splash" in text else "flash" if "pallas_call" in text else "xla"


def _flops(shape: tuple[int, int, int, int, bool]) -> float:
    b, t, n, h, causal = shape
    return 3 * 4 * b * n * t * t * h / (2 if causal else 1)


def measure(
    name: str, shape: tuple[int, int, int, int, bool], case: str, fn: Callable, repeats: int
) -> _stats.Row:
    """One row: the case's fwd+bwd time at ``shape`` in ms (a FAILED row when it raises)."""
    args = _inputs(shape)
    note = f"[{', '.join(map(str, shape[:4]))}] {'causal' if shape[4] else 'full'}"
    if case == "default":
        note += f"; took {_kernel_taken(fn, args)}"
    try:
        step = _step(fn, shape[3])
        for _ in range(2):  # the first compiles
            jax.block_until_ready(step(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append((time.perf_counter() - start) * 1e3)
    except Exception as error:  # a FAILED row: the other cells still run
        first = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        row = _stats.row(f"attention/{name}", case, "ms", [], note=f"{note}; FAILED: {first}")
        row["failed"] = True
        return row
    return _stats.row(f"attention/{name}", case, "ms", times, note=note)


def table(rows: list[_stats.Row]) -> str:
    """One markdown table: shape, implementation, ms, TFLOP/s, vs xla, note."""
    lines = [
        "| model | implementation | fwd+bwd ms | TFLOP/s | vs xla | note |",
        "|---|---|---|---|---|---|",
    ]
    xla = {r["benchmark"]: r["median"] for r in rows if r["case"] == "xla"}
    for r in rows:
        name = r["benchmark"].split("/", 1)[1]
        if r.get("failed"):
            lines.append(f"| {name} | {r['case']} | FAILED | | | {r['note']} |")
            continue
        rate = _flops(r["shape"]) / (r["median"] * 1e-3) / 1e12
        ratio = xla.get(r["benchmark"], float("nan")) / r["median"]
        cell = _stats.fmt_cell(r)
        lines.append(f"| {name} | {r['case']} | {cell} | {rate:.3g} | {ratio:.2f}x | {r['note']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU, interpret")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--blocks", default="256,512,1024", help="splash blocks to try")
    parser.add_argument("--models", default=",".join(SHAPES), help="a comma list of models")
    parser.add_argument("--json", help="write the rows there too")
    args = parser.parse_args(argv)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    repeats = 1 if args.dry_run else args.repeats
    blocks = None if args.dry_run else [int(b) for b in args.blocks.split(",") if b]
    unknown = set(args.models.split(",")) - set(shapes)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; pick from {', '.join(shapes)}")
    print(f"attention fwd+bwd on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"bf16, median of {repeats} after 2 warm-up calls", flush=True)  # fmt: skip
    rows = []
    for name in args.models.split(","):
        shape = shapes[name]
        for case, fn in _cases(shape, blocks, interpret=args.dry_run).items():
            row = measure(name, shape, case, fn, repeats)
            row["shape"] = shape
            rows.append(row)
            print(f"  {name} {case}: {_stats.fmt_cell(row) if row['n'] else 'FAILED'} ms "
                  f"({row['note']})", flush=True)  # fmt: skip
    print(table(rows))
    if args.json:
        _stats.write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
