"""Cold vs warm start with JAX's persistent compilation cache (jaxcore.enable_compile_cache).

Each repeat makes an empty cache directory and starts two fresh processes on it: the first
(cold) compiles and writes the cache, the second (warm) reads it. Each process builds a small
transformer encoder's sharded train step as the shell does on its first batch: the state's init
compiles in the background (``jaxcore.start_train_state``) while the step is AOT-compiled on the
state's shapes (``Step.compile``); then one step runs. It reports the init's seconds on the
main thread (its trace, and the wait for its compile after the step's), the step's compile
and the start-to-first-step seconds. A third process per
repeat runs with the cache off as the baseline. Medians and min-max over the repeats.

    .venv/bin/python benchmarks/compile_cache.py --repeats 5 --devices 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(cache_dir: str | None, layers: int) -> dict[str, float]:
    """One process: time to a compiled, executed first train step."""
    t0 = time.perf_counter()
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcore

    if cache_dir:
        jaxcore.enable_compile_cache(cache_dir)
    t_import = time.perf_counter()

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:  # x: [B, T, F]
            h = nn.Dense(64, name="embed")(x)
            for i in range(layers):
                y = nn.LayerNorm()(h)
                h = h + nn.MultiHeadDotProductAttention(num_heads=4, name=f"attn_{i}")(y, y)
                y = nn.gelu(nn.Dense(128, name=f"fc1_{i}")(nn.LayerNorm()(h)))
                h = h + nn.Dense(64, name=f"fc2_{i}")(y)
            return nn.Dense(10, name="head")(h.mean(axis=1))

    mesh = jaxcore.make_mesh({"data": -1})
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(16, 16, 8)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 10, 16), jnp.int32),
    }
    model = jaxcore.linen_model(Encoder())
    tx = jaxcore.make_optimizer("adamw", lr=1e-3)
    # the init compiles in the background while the step compiles on the state's shapes
    pending = jaxcore.start_train_state(
        model, tx, batch, seed=0, mesh=mesh, param_shardings=jaxcore.state_sharding_fn(mesh)
    )
    t_init = time.perf_counter()
    sharding = jaxcore.batch_sharding(mesh)
    step = jaxcore.make_train_step(
        model,
        jaxcore.softmax_cross_entropy,
        tx,
        state_sharding=jaxcore.state_shardings(pending.abstract),
        batch_sharding=sharding,
    )
    batch = jax.device_put(batch, sharding)
    stats = step.compile(pending.abstract, batch)
    t_wait = time.perf_counter()
    state = pending.result()
    init_wait = time.perf_counter() - t_wait
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    t_end = time.perf_counter()
    return {
        "import": t_import - t0,
        "init": t_init - t_import + init_wait,
        "step_compile": stats.compile_seconds,
        "first_step": t_end - t_import,
    }


def run(cache_dir: str | None, layers: int, devices: int) -> dict[str, float]:
    # JAX's own cache settings left out (a test may pass its cache to the children it
    # starts): the cache here is the one this benchmark chooses, or none
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, __file__, "--child", "--layers", str(layers)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.cache_dir, args.layers)))
        return

    rows: dict[str, list[dict[str, float]]] = {"no cache": [], "cold": [], "warm": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            rows["no cache"].append(run(None, args.layers, args.devices))
            rows["cold"].append(run(tmp, args.layers, args.devices))
            rows["warm"].append(run(tmp, args.layers, args.devices))

    keys = ("init", "step_compile", "first_step")
    print(
        f"encoder, {args.layers} layers, {args.devices} CPU devices, {args.repeats} repeats; "
        "seconds, median [min-max] (first_step: after imports, to one executed step)"
    )
    print(f"{'start':<10}" + "".join(f"{k:>24}" for k in keys))
    med: dict[str, dict[str, float]] = {}
    for name, runs in rows.items():
        med[name] = {k: statistics.median(r[k] for r in runs) for k in keys}
        cells = [
            f"{med[name][k]:.3f} [{min(r[k] for r in runs):.3f}-{max(r[k] for r in runs):.3f}]"
            for k in keys
        ]
        print(f"{name:<10}" + "".join(f"{c:>24}" for c in cells))
    ratios = [med["cold"][k] / med["warm"][k] if med["warm"][k] else float("inf") for k in keys]
    print(f"{'cold/warm':<10}" + "".join(f"{r:>23.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
